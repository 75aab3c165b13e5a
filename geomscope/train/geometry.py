"""Gradient geometry logged during fine-tuning: ``geomscope finetune --log-geometry EVERY``.

Bernas et al. 2026 ("Revisiting Anisotropy in Language Transformers: The Geometry of Learning
Dynamics") find that the gradients of the loss with respect to the hidden states concentrate in the
top principal directions of the hidden states themselves. :mod:`geomscope.metrics.subspace`
measures this on stored runs; this module measures it on the training batches as the model trains.

Every ``EVERY`` optimiser steps (steps ``EVERY, 2 EVERY, ...`` of the run's global step count), for
each chosen layer ``l`` (``--layers``, the layers of the I-STAR penalty):

* g_t = dL_task/dh_t for the real tokens t of the batch (attention mask 1; padding never counts
  here), with L_task the step's task loss exactly as the optimiser sees it (the summed cross-entropy
  times world_size / global batch size), taken with ``torch.autograd.grad(..., retain_graph=True)``
  before ``backward()``: the parameter gradients and the update are untouched (bitwise). Under fp16
  the loss is multiplied by the gradient scaler's scale before differentiation and the gradients
  divided by it afterwards (no underflow), in float64.
* S_l = sum_t g_t g_t^T (D x D, float64 on the training device). Under DDP each process's gradient
  rows are its own tokens; S_l is summed over the processes (one all-reduce on every process), so
  the logged numbers are those of the *global* batch, as in a single process.
* U_r = the top-r eigenvectors of the current C0: the covariance that
  :func:`geomscope.train.evaluate.compute_c0` computes at the start of every epoch from up to
  ``--c0-points`` training token vectors of *all* chosen layers pooled (the union of the layers'
  tokens, centred on the union's mean; padding excluded unless ``--include-padding``). I-STAR runs
  use the C0 of the penalty itself; CosReg / none runs compute the same C0 when --log-geometry is
  on (no gradient, eval mode: training is not changed; eval.jsonl's ``c0_points_used`` then counts
  its points). So U_r is one subspace shared by all chosen
  layers, not each layer's own principal subspace; with a single chosen layer it is that layer's.
* per rank r (``--geometry-rank``, each below the hidden size D), the quantities of
  :func:`geomscope.metrics.subspace.gradient_energy` (without its random controls):

      energy      E     = tr(U_r^T S U_r) / tr(S)           in [0, 1]
      baseline          = r / D                              (E of an isotropic S)
      energy_max  E_max = (top-r eigenvalues of S) / tr(S)   (the best of any rank-r subspace)
      kappa             = (E - r/D) / (E_max - r/D)          (null when E_max - r/D < 1e-12)

* the batch IsoScore* of the layer's own token vectors (global batch, float64, zeta = --zeta,
  padding as --include-padding) with the same shrinkage target as the step's aggregated
  ``isoscore_star``: C0 for I-STAR runs, the trace-matched identity otherwise.

The step record of ``steps.jsonl`` then carries (ranks as strings, layers named as
``geomscope extract`` names them)::

    "geometry": {"layer_01": {"isoscore_star": 0.41,
                              "energy": {"8": 0.62, "32": 0.85},
                              "energy_max": {"8": 0.90, "32": 0.99},
                              "baseline": {"8": 0.0104, "32": 0.0417},
                              "kappa": {"8": 0.68, "32": 0.86}}, ...},
    "geometry_seconds": 0.012

(null marks an undefined value: zero gradients, a non-finite S, a layer without variance; E and
E_max are clipped to [0, 1] against float64 rounding). Steps that are not logged, and a step whose
loss is not finite, have no ``geometry`` key; a logged step's ``seconds`` includes
``geometry_seconds``. ``run.json`` describes it under ``"geometry"``
(:meth:`GeometryLog.metadata`).

Cost of a logged step: one extra backward pass from the task loss to the earliest chosen layer
(no parameter gradients), one (D, D) float64 product per layer, a batched eigvalsh of the L
matrices S (for E_max), and per epoch one eigh of C0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from geomscope import distributed as dd
from geomscope.errors import InputError
from geomscope.layers import layer_name
from geomscope.metrics.isotropy import isoscore_star_from_cov_torch
from geomscope.train.regularizers import batch_covariance, select_tokens

# a difference of fractions in [0, 1] below this is float64 rounding (as metrics.subspace)
_TINY = 1e-12


def check_ranks(ranks: Sequence, dim: int | None = None) -> tuple[int, ...]:
    """``--geometry-rank`` values -> a tuple of distinct whole numbers 1 <= r (< D when ``dim``)."""
    if isinstance(ranks, (int, str)):
        ranks = [ranks]
    out: list[int] = []
    for r in ranks:
        try:
            if isinstance(r, bool):
                raise ValueError
            v = int(str(r).strip()) if isinstance(r, str) else int(r)
            if v != r and not isinstance(r, str):
                raise ValueError
        except (TypeError, ValueError):
            raise InputError(
                f"--geometry-rank must be a comma list of whole numbers (e.g. 8,32); got {r!r}"
            ) from None
        if v < 1:
            raise InputError(f"--geometry-rank {v} is below 1; use ranks from 1 to D - 1")
        if dim is not None and v >= dim:
            raise InputError(
                f"--geometry-rank {v} is not below the model's hidden size D = {dim}; "
                f"use ranks from 1 to {dim - 1} (e.g. --geometry-rank {max(1, dim // 4)})"
            )
        if v not in out:
            out.append(v)
    if not out:
        raise InputError("--geometry-rank is empty; pass at least one rank, e.g. 8,32")
    return tuple(out)


class GeometryLog:
    """Per-layer gradient energy in the top-r subspace of C0 and batch IsoScore* (module docstring)."""

    def __init__(
        self,
        layers: list[int],
        n_hidden_states: int,
        dim: int,
        ranks: Sequence[int],
        zeta: float,
        include_padding: bool,
        d: dd.Dist,
        isoscore_target_c0: bool,
    ):
        self.layers = list(layers)
        self.names = [layer_name(i, n_hidden_states) for i in self.layers]
        self.dim = int(dim)
        self.ranks = check_ranks(ranks, self.dim)
        self.zeta = float(zeta)
        self.include_padding = include_padding
        self.d = d
        self.isoscore_target_c0 = isoscore_target_c0
        self.C0 = self.U = None

    def metadata(self, every: int) -> dict:
        """What the ``geometry`` records of steps.jsonl hold (written into run.json)."""
        return {
            "every": every,
            "ranks": list(self.ranks),
            "layers": self.names,
            "dim": self.dim,
            "gradient": "g_t = d(task loss)/d(hidden state) of the step, real tokens only (padding "
            "excluded), S = sum_t g_t g_t^T in float64"
            + (", summed over the processes (global batch)" if self.d.active else ""),
            "subspace": "U_r = top-r eigenvectors of C0, the covariance of the training tokens of all "
            f"chosen layers {self.names} pooled, recomputed at the start of every epoch; one U_r "
            "shared by all chosen layers",
            "energy": "tr(U_r^T S U_r) / tr(S); baseline r/D; energy_max = top-r eigenvalues of S / tr(S); "
            "kappa = (energy - r/D) / (energy_max - r/D)",
            "isoscore_target": "C0" if self.isoscore_target_c0 else "trace-matched identity",
        }

    def set_c0(self, C0: torch.Tensor) -> None:
        """A new epoch's C0: its top max(ranks) eigenvectors, descending, as float64 (D, r_max)."""
        C0 = C0.to(torch.float64)
        self.C0 = C0
        self.U = None
        if bool(torch.isfinite(C0).all()):
            _, v = torch.linalg.eigh((C0 + C0.T) / 2)
            self.U = v[:, -max(self.ranks) :].flip(-1).contiguous()

    def hidden_grads(self, task_loss: torch.Tensor, hidden_states, scale: float | None = None) -> list:
        """d(task_loss)/d(hidden state) of each chosen layer, graph kept for the step's backward()."""
        hs = [hidden_states[i] for i in self.layers]
        live = [j for j, h in enumerate(hs) if h.requires_grad]
        grads: list = [None] * len(hs)
        if live:
            target = task_loss if scale is None else task_loss * scale
            got = torch.autograd.grad(target, [hs[j] for j in live], retain_graph=True, allow_unused=True)
            for j, g in zip(live, got, strict=True):
                grads[j] = g
        out = []
        for g, h in zip(grads, hs, strict=True):
            g = torch.zeros_like(h, dtype=torch.float64) if g is None else g.detach().to(torch.float64)
            out.append(g if scale is None else g / scale)
        return out

    def record(self, hidden_states, grads: list, attention_mask) -> dict:
        """The step's ``geometry`` record (collectives on every process, in the same order)."""
        with torch.no_grad():
            S = torch.stack(
                [(G.T @ G) for G in (select_tokens((g,), [0], attention_mask, False) for g in grads)]
            )
            S = dd.all_reduce_sum(S, self.d)
            isos = []
            for i in self.layers:
                X = select_tokens(hidden_states, [i], attention_mask, self.include_padding).detach()
                C = batch_covariance(X, self.d.reg_group)
                C0 = self.C0 if self.isoscore_target_c0 else None
                iso = isoscore_star_from_cov_torch(C, self.zeta, C0, check=False)
                isos.append(iso)
            iso_v = torch.stack(isos).cpu().tolist()
            energies = self._energies(S)
        out = {}
        for j, name in enumerate(self.names):
            rec = {"isoscore_star": iso_v[j]}
            rec.update(energies[j])
            out[name] = rec
        return out

    def _energies(self, S: torch.Tensor) -> list[dict]:
        base = {str(r): r / self.dim for r in self.ranks}
        empty = {str(r): None for r in self.ranks}
        tr = S.diagonal(dim1=-2, dim2=-1).sum(-1)
        rmax = max(self.ranks)
        ok = bool(torch.isfinite(S).all()) and self.U is not None
        if ok:
            U = self.U.to(S.device)
            cum_e = ((U * (S @ U)).sum(-2).cumsum(-1) / tr[:, None]).cpu()
            lam = torch.linalg.eigvalsh(S).flip(-1)[:, :rmax]
            cum_m = (lam.cumsum(-1) / tr[:, None]).cpu()
        tr = tr.cpu().tolist()
        out = []
        for j in range(S.shape[0]):
            if not (ok and tr[j] > 0):
                out.append({"energy": empty, "energy_max": empty, "baseline": base, "kappa": empty})
                continue
            e, m, k = {}, {}, {}
            for r in self.ranks:
                ev = min(1.0, max(0.0, float(cum_e[j, r - 1])))
                mv = min(1.0, max(0.0, float(cum_m[j, r - 1])))
                e[str(r)], m[str(r)] = ev, mv
                b = r / self.dim
                k[str(r)] = (ev - b) / (mv - b) if mv - b > _TINY else None
            out.append({"energy": e, "energy_max": m, "baseline": base, "kappa": k})
        return out
