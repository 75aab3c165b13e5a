"""Gradient geometry logged during fine-tuning: ``geomscope finetune --log-geometry EVERY``.

Bernas et al. 2026 ("Revisiting Anisotropy in Language Transformers: The Geometry of Learning
Dynamics") find that the gradients of the loss with respect to the hidden states concentrate in the
top principal directions of the hidden states themselves, far beyond random directions of the same
rank. ``score GRADRUN --basis ACTRUN`` measures this on stored runs
(:mod:`geomscope.score.gradenergy`); this module measures it on the training batches as the model
trains, with the same functions, so that the two give the same numbers on the same rows.

Every ``EVERY`` optimiser steps (steps ``EVERY, 2 EVERY, ...`` of the run's global step count), for
each chosen layer ``l`` (``--layers``, the layers of the I-STAR penalty), over the real tokens t of
the step's batch (attention mask 1; padding never counts here):

* g_t = dL_task/dh_t, with L_task the step's task loss exactly as the optimiser sees it, taken with
  ``torch.autograd.grad(..., retain_graph=True)`` before ``backward()``: the parameter gradients and
  the update are untouched (bitwise). Under fp16 the loss is multiplied by the gradient scaler's
  scale before differentiation and the gradients divided by it afterwards (no underflow), in
  float64.
* the float64 :class:`~geomscope.metrics.moments.Moments` of the rows g_t and of the rows h_t (the
  layer's hidden states of the same tokens); under DDP each process's are its own tokens, and they
  are merged over the processes in rank order, so the numbers are those of the *global* batch.
* S = sum_t g_t g_t^T and g-bar from the gradient moments
  (:func:`geomscope.score.gradenergy.second_moment`), C_act = the covariance (divide by n - 1) of
  the h_t, and per rank r (``--geometry-rank``) :func:`geomscope.metrics.subspace.gradient_energy`
  (S, g-bar, C_act, r, K controls seeded by ``--seed``): the layer's own top-r activation subspace
  U_r of this batch, and

      energy             E     = tr(U_r^T S U_r) / tr(S)           in [0, 1]
      baseline                 = r / D                              (E of an isotropic S)
      energy_max         E_max = (top-r eigenvalues of S) / tr(S)   (the best of any rank-r subspace)
      kappa                    = (E - r/D) / (E_max - r/D)
      control_energy_mean, control_energy_sd: of E_k over K random rank-r subspaces of U_r's
                               complement (``--geometry-controls`` K)
      p_value                  = (1 + #{E_k >= E}) / (K + 1)
      energy_ratio             = E / control_energy_mean

  These are the numbers ``score GRADRUN --basis GRADRUN --rank r --controls K --seed S`` reports for
  a run of ``extract --capture activations,gradients`` of the same model on the same rows with a
  loss proportional to the step's (a causal LM on documents of one length, for instance), to float
  rounding: ``tests/test_train_geometry.py`` checks it on a checkpoint saved mid-training. A rank
  beyond the batch covariance's numerical rank (a batch of n tokens has rank at most n - 1) has
  null values, as in ``score``.
* the batch IsoScore* of the layer's own token vectors (global batch, float64, zeta = --zeta,
  padding as --include-padding) with the same shrinkage target as the step's aggregated
  ``isoscore_star``: C0 for I-STAR runs, the trace-matched identity otherwise.

The step record of ``steps.jsonl`` then carries (ranks as strings, layers named as
``geomscope extract`` names hidden states; the last hidden state of a model with a final norm is
that norm's output, extract's ``final_norm``)::

    "geometry": {"layer_01": {"tokens": 412, "isoscore_star": 0.41,
                              "energy": {"8": 0.62, "32": 0.85},
                              "energy_max": {"8": 0.90, "32": 0.99},
                              "baseline": {"8": 0.0104, "32": 0.0417},
                              "kappa": {"8": 0.68, "32": 0.86},
                              "control_energy_mean": {"8": 0.011, "32": 0.043},
                              "control_energy_sd": {"8": 0.004, "32": 0.007},
                              "p_value": {"8": 0.048, "32": 0.048},
                              "energy_ratio": {"8": 56.4, "32": 19.8}}, ...},
    "geometry_seconds": 0.012

(null marks an undefined value: zero gradients, a layer without variance, a rank past the batch's
numerical rank, controls where 2r > D). Steps that are not logged, and a step whose loss is not
finite, have no ``geometry`` key; a logged step's ``seconds`` includes ``geometry_seconds``.
``run.json`` describes it under ``"geometry"`` (:meth:`GeometryLog.metadata`).

Cost of a logged step: one extra backward pass from the task loss to the earliest chosen layer (no
parameter gradients), the rows of each chosen layer copied to the host in float64, and per layer
two partial eigendecompositions of (D, D) matrices and K products of S with D x r blocks per rank
(``score --basis``'s arithmetic).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from geomscope import distributed as dd
from geomscope.choices import DEFAULT_CONTROLS
from geomscope.errors import DataError, InputError
from geomscope.layers import layer_name
from geomscope.metrics.isotropy import isoscore_star_from_cov_torch
from geomscope.metrics.moments import Moments
from geomscope.train.config import geometry_ranks
from geomscope.train.evaluate import merged_layers
from geomscope.train.regularizers import batch_covariance, select_tokens

#: the per-rank values of a layer's record, from gradient_energy's rows (baseline always defined)
RANK_KEYS = (
    "energy",
    "energy_max",
    "baseline",
    "kappa",
    "control_energy_mean",
    "control_energy_sd",
    "p_value",
    "energy_ratio",
)


def check_ranks(ranks, dim: int | None = None) -> tuple[int, ...]:
    """``--geometry-rank`` values (checked as :class:`FinetuneConfig` declares them) -> a tuple of
    distinct whole numbers 1 <= r, each below the hidden size D when ``dim``."""
    out = tuple(dict.fromkeys(geometry_ranks(ranks)))
    for v in out:
        if dim is not None and v >= dim:
            raise InputError(
                f"--geometry-rank {v} is not below the model's hidden size D = {dim}; "
                f"use ranks from 1 to {dim - 1} (e.g. --geometry-rank {max(1, dim // 4)})"
            )
    return out


class GeometryLog:
    """Per-layer gradient energy in the layer's own top-r activation subspace of the step's batch,
    with matched-rank normal controls, and the batch IsoScore* (module docstring)."""

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
        controls: int = DEFAULT_CONTROLS,
        seed: int = 0,
    ):
        self.layers = list(layers)
        self.names = [layer_name(i, n_hidden_states) for i in self.layers]
        self.dim = int(dim)
        self.ranks = check_ranks(ranks, self.dim)
        self.zeta = float(zeta)
        self.include_padding = include_padding
        self.d = d
        self.isoscore_target_c0 = isoscore_target_c0
        self.controls, self.seed = int(controls), int(seed)
        self.C0 = None

    def metadata(self, every: int) -> dict:
        """What the ``geometry`` records of steps.jsonl hold (written into run.json)."""
        over = ", merged over the processes (global batch)" if self.d.active else ""
        return {
            "every": every,
            "ranks": list(self.ranks),
            "layers": self.names,
            "dim": self.dim,
            "controls": self.controls,
            "control_seed": self.seed,
            "gradient": "g_t = d(task loss)/d(hidden state) of the step, real tokens only (padding "
            f"excluded); S = sum_t g_t g_t^T in float64{over}",
            "subspace": "U_r = top-r eigenvectors of the layer's own activation covariance (ddof 1) over "
            f"the same real-token rows of the step's batch{over}",
            "energy": "metrics.subspace.gradient_energy(S, g-bar, C_act, ranks, controls, seed), as "
            "score --basis: energy tr(U_r^T S U_r) / tr(S); baseline r/D; energy_max = top-r "
            "eigenvalues of S / tr(S); kappa = (energy - r/D) / (energy_max - r/D); controls: K random "
            "rank-r subspaces of U_r's complement (mean, SD, p_value, energy_ratio)",
            "isoscore_target": "C0" if self.isoscore_target_c0 else "trace-matched identity",
        }

    def set_c0(self, C0: torch.Tensor) -> None:
        """A new epoch's C0: the shrinkage target of the logged batch IsoScore* of an I-STAR run."""
        self.C0 = C0.to(torch.float64)

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
        L = len(self.layers)
        with torch.no_grad():
            rows = [select_tokens(hidden_states, [i], attention_mask, False).detach() for i in self.layers]
            rows += [select_tokens((g,), [0], attention_mask, False) for g in grads]
            parts = [_moments(x, self.dim) for x in rows]
            # a layer with a NaN or an Inf on some process has no energies (a partial merge would mislead)
            bad = torch.tensor([float(m is None) for m in parts], dtype=torch.float64, device=self.d.device)
            bad = dd.all_reduce_sum(bad, self.d).cpu().tolist()
            merged = merged_layers(
                [Moments(self.dim, extras=False) if m is None else m for m in parts], self.d
            )
            iso_v = self._isoscores(hidden_states, attention_mask)
        out = {}
        for j, name in enumerate(self.names):
            act, grad = merged[j], merged[L + j]
            finite = bad[j] == 0 and bad[L + j] == 0
            out[name] = {
                "tokens": int(act.n),
                "isoscore_star": iso_v[j],
                **self.energies(act, grad, defined=finite),
            }
        return out

    def _isoscores(self, hidden_states, attention_mask) -> list:
        isos = []
        for i in self.layers:
            X = select_tokens(hidden_states, [i], attention_mask, self.include_padding).detach()
            C = batch_covariance(X, self.d.reg_group)
            C0 = self.C0 if self.isoscore_target_c0 else None
            isos.append(isoscore_star_from_cov_torch(C, self.zeta, C0, check=False))
        return torch.stack(isos).cpu().tolist()

    def energies(self, act: Moments, grad: Moments, defined: bool = True) -> dict:
        """The per-rank values (:data:`RANK_KEYS`) of one layer from its merged activation and
        gradient moments, by ``score --basis``'s functions; null where they are undefined (and all
        null unless ``defined``)."""
        from geomscope.metrics.subspace import gradient_energy
        from geomscope.score.gradenergy import second_moment

        rows = None
        if defined and act.n >= 2 and grad.n >= 1:
            S, gbar = second_moment(grad)
            try:
                rows = gradient_energy(
                    S,
                    gbar,
                    act.covariance(),
                    self.ranks,
                    controls=self.controls,
                    seed=self.seed,
                    zeta=self.zeta,
                )
            except DataError:  # zero gradients, no activation variance, a non-finite value
                rows = None
        out: dict = {key: {} for key in RANK_KEYS}
        for k, r in enumerate(self.ranks):
            for key in RANK_KEYS:
                out[key][str(r)] = rows[k][key] if rows is not None else None
            out["baseline"][str(r)] = r / self.dim
        return out


def _moments(rows: torch.Tensor, dim: int) -> Moments | None:
    """The float64 moments of ``rows`` (N, D), on the host; None when a row holds a NaN or an Inf."""
    try:
        return Moments(dim, extras=False).update(rows.to(torch.float64).cpu())
    except DataError:
        return None
