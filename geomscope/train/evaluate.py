"""No-gradient passes over a dataset: the I-STAR shrinkage target C0 and per-epoch evaluation.

Both run the model in eval mode under ``torch.no_grad`` (autocast as in training), each rank over
its strided shard of the examples, and sum float64 moments over ranks.

* C0 = sample covariance of up to ``max_points`` token vectors of the chosen layers (each token
  of each chosen layer is one point; padding excluded unless ``include_padding``), taken from the
  training examples in this epoch's training order.  Each rank collects at most
  ``max_points // world_size`` points, whole tokens only, into a float64
  :class:`~geomscope.metrics.moments.Moments`; the ranks' accumulators are merged in rank order
  and the result broadcast from rank 0, so C0 is bitwise identical on every rank.
* Evaluation: accuracy, macro-F1 (mean over the classes that occur in the eval labels or the
  predictions of F1 = 2TP / (2TP + FP + FN)), mean cross-entropy, and the geometry of the eval
  set's token vectors over the chosen layers (:class:`EvalGeometry`, shared with the
  question-answering evaluation :func:`geomscope.train.qa.evaluate_qa`).  It is taken over the real
  tokens only, whatever ``--include-padding`` says for the penalties: how many padding rows a batch
  holds depends on the batch size and on which examples share a batch, so counting them would make
  the eval geometry a function of ``--batch-size``.

Eval geometry.  X_l is the (n, D) matrix of chosen layer l's real eval tokens, X_pool the union of
the chosen layers' rows (L n rows, centred on the union's mean, as the I-STAR penalty centres its
batch), C_l and C_pool their sample covariances (divide by rows - 1).  With D the hidden size,
zeta the run's ``--zeta`` and, for a covariance M::

    IsoScore(M) = (tr(M)^2 / ||M||_F^2 - 1) / (D - 1)                 in [0, 1]
    C0s         = (C0 + C0^T) / 2

    isoscore_star_trace_pooled     = IsoScore((1 - zeta) C_pool + zeta tr(C_pool)/D I)
    isoscore_star_trace_per_layer  = {l: IsoScore((1 - zeta) C_l + zeta tr(C_l)/D I)}
    isoscore_star_c0_pooled        = IsoScore((1 - zeta) C_pool + zeta C0s)
    isoscore_star_c0_per_layer     = {l: IsoScore((1 - zeta) C_l + zeta C0s)}
    isoscore_star                  = isoscore_star_trace_pooled
    isoscore                       = IsoScore(C_pool)

C0 is the shrinkage target the I-STAR penalty used in the epoch just trained: the covariance of the
training tokens of all chosen layers pooled, taken by :func:`compute_c0` at the epoch's start (up
to ``--c0-points`` points, padding as ``--include-padding`` says); the penalty of a mini-batch is
1 - IsoScore((1 - zeta) C_batch + zeta C0s), C_batch the C_pool of the batch's training tokens, so
``isoscore_star_c0_pooled`` is the penalty's own quantity on the eval set, and the per-layer
values shrink each layer towards the same pooled C0 (at its absolute scale: a layer whose variance is
small beside the pool's reads close to IsoScore(C0s), whatever its own shape).  The ``_c0`` values
are null in a run that computed no C0 (``--reg cosreg`` or ``none``).
The ``_trace`` values shrink towards the identity scaled to the covariance's own trace, so
tr(C_zeta) = tr(C): they depend on the shape of the eval covariance alone, not on its scale nor on
the training data.  ``isoscore_star`` is the key ``compare`` reads.  Per-layer values are keyed
by the layer index as a string, as ``avgcos_per_layer``.  Also: the average cosine similarity (all
distinct pairs, docs/metrics.md) of the union, of each chosen layer, and of the last layer (CosReg's
layer).  A value whose covariance has fewer than 2 rows or no variance is null.
"""

from __future__ import annotations

import numpy as np
import torch

from geomscope import distributed as dd
from geomscope.errors import DataError
from geomscope.metrics.isotropy import isoscore_from_cov, isoscore_star_from_cov
from geomscope.metrics.moments import Moments
from geomscope.train.regularizers import select_tokens


def forward_batch(model, batch, device, autocast):
    """The model's outputs, hidden states included, on ``batch`` (its labels left out), and the
    batch's attention mask, on ``device``."""
    inputs = {k: v.to(device) for k, v in batch.items() if k != "labels"}
    with autocast():
        return model(**inputs, output_hidden_states=True), inputs["attention_mask"]


def rank_batches(ids: list[int], batch_size: int, d: dd.Dist) -> list[tuple[list[int], bool]]:
    """This rank's strided share of ``ids`` in batches, as ``(batch, real)``.

    Under ``d.lockstep`` (FSDP, where each forward gathers parameters from every process)
    every rank returns as many batches as rank 0, which has the most; the extra ones repeat this rank's
    first batch with ``real`` False: they are run and their outputs dropped, so no process waits for a
    forward that never comes."""
    mine = ids[d.rank :: d.world_size]
    out = [(mine[i : i + batch_size], True) for i in range(0, len(mine), batch_size)]
    if d.lockstep and ids:
        most = -(-len(ids[:: d.world_size]) // batch_size)
        filler = out[0][0] if out else ids[:1]
        out += [(filler, False)] * (most - len(out))
    return out


def eval_batches(model, encoded, geo: EvalGeometry, batch_size: int, d: dd.Dist, autocast):
    """This rank's eval batches (:func:`rank_batches` over every row of ``encoded``), each real one
    as ``(ids, batch, out, mask)``, its geometry added to ``geo`` once the caller has read it.

    The model runs in eval mode without gradients while the batches last and is put back in its
    mode after; lockstep filler forwards run and are dropped."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for ids, real in rank_batches(list(range(len(encoded))), batch_size, d):
                batch = encoded.collate(ids)
                out, mask = forward_batch(model, batch, d.device, autocast)
                if not real:  # lockstep (FSDP): a forward the other processes need
                    continue
                yield ids, batch, out, mask
                geo.update(out, mask)
    finally:
        model.train(was_training)


def _merged(m: Moments, d: dd.Dist) -> Moments:
    """Merge every rank's accumulator in rank order (the same result on every rank)."""
    if not d.active:
        return m
    parts = dd.gather_objects(m, d)
    total = Moments(parts[0].dim, extras=parts[0].extras)
    for p in parts:
        total.merge(p)
    return total


@torch.no_grad()
def compute_c0(
    model,
    encoded,
    order: list[int],
    layers: list[int],
    max_points: int,
    batch_size: int,
    d: dd.Dist,
    autocast,
    include_padding: bool = False,
) -> tuple[torch.Tensor, int]:
    """(C0 as a (D, D) float64 tensor on ``d.device``, number of points used globally)."""
    was_training = model.training
    model.eval()
    budget = max_points // d.world_size
    L = len(layers)
    m = Moments(model.config.hidden_size, extras=False)
    for ids, real in rank_batches(order, batch_size, d):
        full = m.n + L > budget
        if _stop(full, d):
            break
        out, mask = forward_batch(model, encoded.collate(ids), d.device, autocast)
        if full or not real:  # lockstep: a forward the other processes need, its tokens dropped
            continue
        X = select_tokens(out.hidden_states, layers, mask, include_padding)  # (L*t, D), layer-major
        t = X.shape[0] // L
        k = min(t, (budget - m.n) // L)  # whole tokens: the same k tokens from every layer
        m.update(X.reshape(L, t, -1)[:, :k].reshape(L * k, -1))
    model.train(was_training)
    m = _merged(m, d)
    if m.n < 2:
        raise DataError("too few training tokens to estimate C0 (need at least 2 token vectors); add data")
    C0 = torch.from_numpy(m.covariance()).to(d.device)
    return dd.broadcast(C0, d), int(m.n)


def _stop(full: bool, d: dd.Dist) -> bool:
    """C0's early stop: this process has its share of points; under lockstep, every process has (all
    of them ask at every batch, so they stop together)."""
    if not d.lockstep:
        return full
    flag = torch.tensor([1.0 if full else 0.0], dtype=torch.float64, device=d.device)
    return int(dd.all_reduce_sum(flag, d)[0]) == d.world_size


def _macro_f1(conf: torch.Tensor) -> float:
    tp = conf.diag()
    fp = conf.sum(0) - tp
    fn = conf.sum(1) - tp
    present = (conf.sum(0) + conf.sum(1)) > 0
    denom = 2 * tp + fp + fn
    f1 = torch.where(denom > 0, 2 * tp / denom.clamp_min(1), torch.zeros_like(denom))
    return float(f1[present].mean()) if present.any() else 0.0


def _avgcos(u_sum: torch.Tensor, n: torch.Tensor) -> float | None:
    n = float(n)
    return None if n < 2 else float((u_sum.dot(u_sum) - n) / (n * (n - 1)))


class EvalGeometry:
    """Accumulates the eval-set geometry of the module docstring over batches (any task): each chosen
    layer's real tokens in its own float64 :class:`Moments` (the union is their merge), and unit-vector
    sums per chosen layer and of the last layer.

    Padding never counts (see the module docstring): with it, the geometry depended on the batch size."""

    def __init__(self, D: int, layers: list[int], device):
        self.layers, self.D = list(layers), D
        L = len(layers)
        self.per_layer = [Moments(D, extras=True) for _ in layers]
        self.u = torch.zeros(L + 1, D, dtype=torch.float64, device=device)  # each layer, then last layer
        self.counts = torch.zeros(2, dtype=torch.float64, device=device)  # tokens per layer, last layer

    def update(self, out, mask) -> None:
        L, D = len(self.layers), self.D
        X = select_tokens(out.hidden_states, self.layers + [len(out.hidden_states) - 1], mask, False)
        t = X.shape[0] // (L + 1)
        for j, moments in enumerate(self.per_layer):
            moments.update(X[j * t : (j + 1) * t])
        U = X / X.norm(dim=1, keepdim=True).clamp_min(1e-30)
        self.u += U.reshape(L + 1, t, D).sum(1)
        self.counts += torch.tensor([t, t], dtype=torch.float64, device=self.counts.device)

    def finish(self, d: dd.Dist, zeta: float, reduced: tuple | None = None, C0=None) -> dict:
        """The geometry part of the eval record (identical on every rank). ``reduced`` = (u, counts)
        already summed over ranks, when the caller packed them into its own all-reduce; ``C0`` = the
        penalty's shrinkage target of the epoch (a (D, D) tensor or array), None when the run has none."""
        L, D = len(self.layers), self.D
        if reduced is None:
            packed = dd.all_reduce_sum(torch.cat([self.u.reshape(-1), self.counts]), d)
            u, counts = torch.split(packed, [(L + 1) * D, 2])
        else:
            u, counts = reduced
        u = u.reshape(L + 1, D)
        per_layer = merged_layers(self.per_layer, d)
        union = Moments(D, extras=True)
        for moments in per_layer:
            union.merge(moments)
        covs = {"pooled": _covariance_or_none(union)}
        for layer, moments in zip(self.layers, per_layer, strict=True):
            covs[str(layer)] = _covariance_or_none(moments)
        stars = isoscore_stars(covs, zeta, C0)
        return {
            "eval_tokens": int(counts[0]),
            "isoscore": None if covs["pooled"] is None else isoscore_from_cov(covs["pooled"]),
            "isoscore_star": stars["isoscore_star_trace_pooled"],
            **stars,
            "avgcos": _avgcos(torch.from_numpy(union.sum_unit), union.n_unit()) if union.n else None,
            "avgcos_per_layer": {str(layer): _avgcos(u[j], counts[0]) for j, layer in enumerate(self.layers)},
            "avgcos_last_layer": _avgcos(u[L], counts[1]),
        }


def merged_layers(per_layer: list[Moments], d: dd.Dist) -> list[Moments]:
    """Each layer's accumulators merged over the ranks in rank order (one gather for all layers)."""
    if not d.active:
        return per_layer
    parts = dd.gather_objects(per_layer, d)
    merged = [Moments(m.dim, extras=m.extras) for m in per_layer]
    for rank_layers in parts:
        for total, m in zip(merged, rank_layers, strict=True):
            total.merge(m)
    return merged


def _covariance_or_none(m: Moments):
    """The sample covariance of the rows, or None with fewer than 2 rows or no variance."""
    return m.covariance() if m.n >= 2 and m.total_variance() > 0 else None


def isoscore_stars(covs: dict, zeta: float, C0=None) -> dict:
    """``isoscore_star_{trace,c0}_{pooled,per_layer}`` (module docstring) of the covariances ``covs``
    (``"pooled"`` and one per layer name; None where undefined).  The ``_c0`` values are None when
    ``C0`` is None or not finite; only C0's symmetric part counts, as in the penalty."""
    c0 = None
    if C0 is not None:
        c0 = np.asarray(C0.detach().cpu() if isinstance(C0, torch.Tensor) else C0, dtype=np.float64)
        c0 = (c0 + c0.T) / 2 if bool(np.isfinite(c0).all()) else None
    out = {}
    for target, shrink_to in (("trace", "trace"), ("c0", c0)):
        values = {
            name: None if C is None or shrink_to is None else isoscore_star_from_cov(C, zeta, shrink_to)
            for name, C in covs.items()
        }
        out[f"isoscore_star_{target}_pooled"] = values.pop("pooled")
        out[f"isoscore_star_{target}_per_layer"] = values
    return out


@torch.no_grad()
def evaluate(
    model,
    encoded,
    layers: list[int],
    zeta: float,
    batch_size: int,
    d: dd.Dist,
    autocast,
    n_labels: int,
    C0=None,
) -> dict:
    """Per-epoch evaluation record (see module docstring); identical on every rank.  ``C0``: the
    shrinkage target the penalty used this epoch (None: the ``isoscore_star_c0_*`` values are null)."""
    dev = d.device
    D = model.config.hidden_size
    L = len(layers)
    conf = torch.zeros(n_labels, n_labels, dtype=torch.float64, device=dev)
    loss_sum = torch.zeros(1, dtype=torch.float64, device=dev)
    geo = EvalGeometry(D, layers, dev)
    for _, batch, out, _ in eval_batches(model, encoded, geo, batch_size, d, autocast):
        labels = batch["labels"].to(dev)
        logits = out.logits.float()
        loss_sum += torch.nn.functional.cross_entropy(logits, labels, reduction="sum").double()
        conf.index_put_(
            (labels, logits.argmax(-1)),
            torch.ones(len(labels), dtype=torch.float64, device=dev),
            accumulate=True,
        )
    packed = dd.all_reduce_sum(torch.cat([conf.reshape(-1), loss_sum, geo.u.reshape(-1), geo.counts]), d)
    conf, loss_sum, u, counts = torch.split(packed, [n_labels * n_labels, 1, (L + 1) * D, 2])
    conf = conf.reshape(n_labels, n_labels)
    g = geo.finish(d, zeta, (u, counts), C0)
    n_ex = float(conf.sum())
    return {
        "eval_examples": int(n_ex),
        "eval_tokens": g.pop("eval_tokens"),
        "accuracy": float(conf.diag().sum() / max(n_ex, 1.0)),
        "macro_f1": _macro_f1(conf),
        "eval_loss": float(loss_sum[0] / max(n_ex, 1.0)),
        **g,
    }
