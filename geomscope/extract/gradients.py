"""``extract --capture gradients``: g_t = dL/dh_t, the gradient of a loss with respect to a hidden state.

The loss (``--loss``):

- ``causal-lm``: next-token cross-entropy; position t of a document predicts token t + 1, so its
  last position predicts nothing (its gradient in the last layers is 0).
- ``masked-lm``: masked-LM cross-entropy.  Each document's masked positions are drawn from its own
  generator, seeded by ``(--seed, doc_id)``: each ordinary (non-special) token is masked with
  probability ``--mlm-probability``, at least one per document; a masked token is replaced by the
  tokenizer's mask token (no 80/10/10 random replacement: the measurement should not depend on
  more randomness than it needs).  The masked positions are stored per row (``loss_target``).
- ``classification``: cross-entropy of a sequence classifier's logits against the document's label
  (``--label-field``; a label is the model's label name, or a class index).

Each document's loss is the mean over its own predictions (what ``model(..., labels=...)`` returns for
that document alone) and a batch's loss is the sum of its documents' losses, so no document's
gradient depends on the others in its batch, on padding or on the batch size: the stored gradients,
like the activations, do not depend on ``--batch-tokens``.  The model runs in eval mode (no
dropout) and its weights do not take gradients; autograd computes only dL/dh for the kept hidden
states, which are the same tensors ``extract`` stores as activations (``layer_N`` read at the final
norm's input, ``final_norm`` at its output), so ``score --basis`` can pair a gradient layer with the
activation layer of the same name.

A module layer (``extract --modules``) takes the gradient with respect to the module's own tensor
(its output, or the input it reads), from the same backward pass; the q, k and v of a fused
projection are cut from the gradient of its one output.

Gradient layers are stored as ``<layer>.grad``: a run of ``--capture activations,gradients`` holds
both, from one forward and backward pass (the activations of a masked-LM run are those of the
masked input).  Gradients are small numbers (often 1e-6 .. 1e-3), below float16's normal range, so a
gradient run stores float32.
"""

from __future__ import annotations

import numpy as np

from geomscope.errors import InputError
from geomscope.extract.batching import Doc, pad_right, row_meta
from geomscope.extract.capture import Capture
from geomscope.layers import gradient_name

CAPTURES = ("activations", "gradients", "activations,gradients")
REDUCTION = (
    "each document's loss is the mean over its own predictions; a batch's loss is the sum of its "
    "documents' losses (so no gradient depends on the batch)"
)


def parse_capture(spec: str) -> tuple[bool, bool]:
    """``--capture`` -> (store activations, store gradients)."""
    parts = {p.strip().lower() for p in str(spec or "").split(",") if p.strip()}
    if not parts or not parts <= {"activations", "gradients"}:
        raise InputError(f"--capture {spec!r} is not one of {', '.join(CAPTURES)}")
    return "activations" in parts, "gradients" in parts


def label_map(lm) -> tuple[dict[str, int], int]:
    """(the model's label names -> class index, its number of classes)."""
    config = lm.model.config
    return {str(k): int(v) for k, v in (getattr(config, "label2id", None) or {}).items()}, int(
        config.num_labels
    )


def label_index(raw, label2id: dict, n_labels: int, doc_id: int) -> int:
    """A document's class index: a label name of the model, or an index below its number of labels."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        raise InputError(f"document {doc_id} has no label; give every document a label (--label-field)")
    key = str(raw).strip()
    if key in label2id:
        return int(label2id[key])
    try:
        i = int(key)
    except ValueError:
        i = None
    if i is not None and 0 <= i < n_labels:
        return i
    names = ", ".join(list(label2id)[:8])
    raise InputError(
        f"label {raw!r} of document {doc_id} is not one of the model's labels ({names}) nor a class "
        f"index 0..{n_labels - 1}; check --label-field"
    )


def mask_positions(doc: Doc, probability: float, seed: int) -> np.ndarray:
    """The positions of ``doc`` to mask: ordinary tokens each with ``probability``, at least one,
    from a generator seeded by (seed, doc_id) (so they do not depend on the batch or the shard)."""
    ordinary = np.flatnonzero(~doc.special)
    if len(ordinary) == 0:
        return ordinary
    rng = np.random.default_rng([int(seed), int(doc.doc_id)])
    chosen = ordinary[rng.random(len(ordinary)) < probability]
    if len(chosen) == 0:
        chosen = ordinary[[int(rng.integers(len(ordinary)))]]
    return chosen


class GradientCapture(Capture):
    """``capture(docs) -> (layers, meta)`` like :class:`Capture`, with ``<layer>.grad`` rows (and the
    activations too when asked); ``meta`` adds ``loss_target`` (the rows whose prediction is in the
    loss). ``loss_sum`` / ``loss_docs`` / ``docs_without_targets`` add up what the batches gave."""

    def __init__(
        self,
        lm,
        layers: list[dict],
        store_dtype: str,
        *,
        loss: str,
        activations: bool,
        mlm_probability: float = 0.15,
        seed: int = 0,
    ):
        super().__init__(lm, layers, store_dtype)
        self.loss = loss
        self.activations = activations
        self.mlm_probability = float(mlm_probability)
        self.seed = int(seed)
        self.labels: dict[int, int] = {}  # doc_id -> class index (classification), set per shard
        self.loss_sum = 0.0
        self.loss_docs = 0
        self.docs_without_targets = 0
        # read once: the next shard may be being tokenized meanwhile (extract/shards.py), and a fast
        # tokenizer used from two threads at once can fail ("Already borrowed")
        self.mask_id = lm.tokenizer.mask_token_id
        if loss == "masked-lm" and self.mask_id is None:
            raise InputError(
                f"the tokenizer of {lm.info['name']} has no mask token; --loss masked-lm needs one"
            )
        if loss == "classification":
            # a sequence classifier (GPT-2's, Llama's ...) reads its prediction from the last token
            # that is not config.pad_token_id: padded with the tokenizer's pad (or eos) where the two
            # differ, every document shorter than its batch's longest would be classified from
            # padding (its loss and gradients would then depend on the batch)
            cfg_pad = getattr(lm.model.config, "pad_token_id", None)
            if isinstance(cfg_pad, int) and not isinstance(cfg_pad, bool) and cfg_pad >= 0:
                self.pad_id = cfg_pad
        for p in lm.model.parameters():
            p.requires_grad_(False)
        self.out_names = [*(self.names if activations else []), *(gradient_name(n) for n in self.names)]

    def reset_totals(self) -> tuple[float, int, int]:
        """(loss sum, documents, documents without a prediction) since the last reset; then zero them."""
        got = (self.loss_sum, self.loss_docs, self.docs_without_targets)
        self.loss_sum, self.loss_docs, self.docs_without_targets = 0.0, 0, 0
        return got

    def _targets(self, docs: list[Doc], ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(input ids to feed, (B, T) int64 targets with -100 where nothing is predicted)."""
        targets = np.full(ids.shape, -100, dtype=np.int64)
        if self.loss == "causal-lm":
            for b, d in enumerate(docs):
                targets[b, : len(d) - 1] = d.ids[1:]
        elif self.loss == "masked-lm":
            ids = ids.copy()
            mask_id = self.mask_id
            for b, d in enumerate(docs):
                pos = mask_positions(d, self.mlm_probability, self.seed)
                targets[b, pos] = d.ids[pos]
                ids[b, pos] = mask_id
        return ids, targets

    def device_rows(self, docs: list[Doc]) -> tuple[dict, dict[str, np.ndarray]]:
        import torch

        ids, mask = pad_right(docs, self.pad_id)
        ids, targets = self._targets(docs, ids)
        flat = np.flatnonzero(mask.reshape(-1))
        dev = self.lm.device
        t_ids = torch.from_numpy(ids).to(dev)
        t_mask = torch.from_numpy(mask).to(dev)
        grabbed: dict = {}
        handles = [self.lm.model.get_input_embeddings().register_forward_hook(_require_grad)]
        if self.hook_norm:

            def grab(_module, args, output):
                grabbed["pre"] = args[0]
                grabbed["post"] = output[0] if isinstance(output, (tuple, list)) else output

            handles.append(self.lm.final_norm_module().register_forward_hook(grab))
        tapped: dict = {}  # (module, side) -> its tensor, a node of the graph
        detach = self.taps.attach(lambda key, t: tapped.__setitem__(key, _in_graph(t)))
        try:
            with torch.enable_grad():
                out = self.lm.model(
                    input_ids=t_ids,
                    attention_mask=t_mask,
                    output_hidden_states=True,
                    return_dict=True,
                    **self.lm.forward_kwargs,
                )
                loss = self._loss(out.logits, docs, targets)
                # a fused projection's q, k and v share its tensor: its gradient is taken once
                keys = [
                    ("module", self.taps.key(n)) if src == "module" else (src, i)
                    for n, (src, i) in zip(self.names, self.sources, strict=True)
                ]
                unique = list(dict.fromkeys(keys))
                tensors = [_source_tensor(k, out.hidden_states, grabbed, tapped) for k in unique]
                grads = dict(zip(unique, torch.autograd.grad(loss, tensors, allow_unused=True), strict=True))
                tensors = dict(zip(unique, tensors, strict=True))
        finally:
            for h in handles:
                h.remove()
            detach()
        idx = torch.from_numpy(flat).to(dev)

        def rows(name, src, h):
            if src == "module":
                h = self.taps.part(name, h)
            return h.detach().reshape(-1, h.shape[-1]).to(self.torch_dtype).index_select(0, idx)

        result = {}
        for name, (src, _), key in zip(self.names, self.sources, keys, strict=True):
            h, g = tensors[key], grads[key]
            if self.activations:
                result[name] = rows(name, src, h)
            result[gradient_name(name)] = rows(name, src, g if g is not None else torch.zeros_like(h))
        self.batches += 1
        meta = row_meta(docs)
        meta["loss_target"] = (targets.reshape(-1) != -100)[flat]
        return result, meta

    def _loss(self, logits, docs: list[Doc], targets: np.ndarray):
        """Sum over documents of each document's mean cross-entropy (float32 or wider)."""
        import torch
        import torch.nn.functional as F

        dev = logits.device
        if self.loss == "classification":
            y = torch.tensor([self.labels[d.doc_id] for d in docs], device=dev)
            per_doc = F.cross_entropy(logits.float(), y, reduction="none")
            self._count(per_doc, len(docs), 0)
            return per_doc.sum()
        t = torch.from_numpy(targets).to(dev)
        where = (t != -100).reshape(-1).nonzero().squeeze(1)
        flat_logits = logits.reshape(-1, logits.shape[-1]).index_select(0, where).float()
        ce = F.cross_entropy(flat_logits, t.reshape(-1).index_select(0, where), reduction="none")
        per_row_doc = torch.div(where, t.shape[1], rounding_mode="floor")
        counts = torch.bincount(per_row_doc, minlength=len(docs)).to(ce.dtype)
        per_doc = torch.zeros(len(docs), device=dev, dtype=ce.dtype).index_add_(0, per_row_doc, ce)
        have = counts > 0
        per_doc = torch.where(have, per_doc / counts.clamp(min=1), per_doc)
        self._count(per_doc, int(have.sum()), int((~have).sum()))
        return per_doc.sum()

    def _count(self, per_doc, docs_with_targets: int, without: int) -> None:
        self.loss_sum += float(per_doc.detach().double().sum())
        self.loss_docs += docs_with_targets
        self.docs_without_targets += without


def _source_tensor(key, hidden_states, grabbed: dict, tapped: dict):
    """The tensor a gradient is taken with respect to: a hidden state (``("hs", i)``), the final
    norm's input or output (``("pre" | "post", i)``), or a module's tensor (``("module", (path,
    side))``)."""
    src, i = key
    if src == "hs":
        return hidden_states[i]
    return tapped[i] if src == "module" else grabbed[src]


def _in_graph(tensor):
    """A module's tensor as a node of the graph: one computed from nothing that takes a gradient
    (the position embeddings, say) is made a leaf that does, so the loss's gradient reaches it."""
    if not tensor.requires_grad and tensor.is_floating_point():
        tensor.requires_grad_(True)
    return tensor


def _require_grad(_module, _args, output):
    """Make the input embeddings part of the graph, so every hidden state after them has a gradient
    (the weights do not require one)."""
    if not output.requires_grad:
        output.requires_grad_(True)
    return output
