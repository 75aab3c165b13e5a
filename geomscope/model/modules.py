"""Any module of a model as a layer: the ``extract --modules`` patterns and aliases, matched against
the model's modules, and what each matched module gives per token.

Names. A module is named by its path in the base model (``model.base_model.named_modules()``:
``layers.3.attention`` in a GPT-NeoX, ``encoder.layer.3.output.dense`` in a BERT). A pattern may
also spell it with the checkpoint's base-model prefix, as a model with a head names it
(``gpt_neox.layers.3.attention``, ``bert.encoder.layer.3.output.dense``), so one pattern names the
same module whether extract loads the bare model or the one with a head (``--capture gradients``).
Patterns are fnmatch globs, matched case-sensitively against the whole path: ``*`` matches any
characters, dots included (``*.mlp`` is every module called ``mlp``), ``?`` one, ``[...]`` a set.
Only modules of the stack extract reads count (an encoder-decoder model's encoder, by default).

Sides. ``PATTERN`` (or ``PATTERN:out``) is the module's output; ``PATTERN:in`` its input: its first
positional argument, else its ``hidden_states`` keyword. A module that returns a tuple (attention
modules return their output, then weights or a cache) gives the first element. ``PATTERN:q``,
``:k``, ``:v`` split a fused query-key-value projection (:data:`FUSED_QKV`). What is kept must be one
vector per token (shape (batch, tokens, width)), computed once per forward pass; its width is its
own (the hidden size D, or the keys of grouped-query attention, n_kv_heads x d_head, or an MLP's
intermediate 4D), recorded with the layer. An exactly named module that is not is refused; a glob
keeps the modules that are and the others are listed as left out.

Aliases (:data:`FAMILY_MODULES`) name the same place in every block of the families whose layout
geomscope knows: ``attn_out`` and ``mlp_out`` (what the attention and MLP sub-layers add to the
residual stream, after their output projection: BERT's before its post-LN), ``ln1_in``/``ln1_out``
and ``ln2_in``/``ln2_out`` (the input and output of the block's first and second norm in forward
order: BERT's post-attention and post-MLP LayerNorms), and ``q``, ``k``, ``v`` (the query, key and
value projections, concatenated over heads -- n_heads x d_head wide, the projection's own head
order; the keys and values of grouped-query attention n_kv_heads x d_head -- before rotary position
embeddings and before the 1/sqrt(d_head) scaling). ``norms`` is every
norm module of the stack (LayerNorm, RMSNorm, T5LayerNorm...: :func:`~geomscope.model.norms.is_norm`)
at its input and its output, in every family.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from geomscope.errors import InputError

#: the parts of a fused query-key-value projection (``PATTERN:q``)
QKV = ("q", "k", "v")
#: the sides of a module: its output (the default) or its input
SIDES = ("out", "in")
#: aliases with a side: each family's ``ln1`` / ``ln2`` module at its input and its output
NORM_ALIASES = {
    "ln1_in": ("ln1", "in"),
    "ln1_out": ("ln1", "out"),
    "ln2_in": ("ln2", "in"),
    "ln2_out": ("ln2", "out"),
}
#: every norm module of the stack, at its input and its output
ALL_NORMS = "norms"
ALIASES = ("attn_out", "mlp_out", *NORM_ALIASES, *QKV, ALL_NORMS)

#: per family, the path inside a block (``<blocks>.<k>.<path>``) each alias names; ``ln1`` and ``ln2``
#: give ``ln1_in``, ``ln1_out``, ``ln2_in``, ``ln2_out``; ``PATH:q`` is a part of a fused projection
FAMILY_MODULES: dict[str, dict[str, str]] = {
    "bert": {
        "attn_out": "attention.output.dense",
        "mlp_out": "output.dense",
        "ln1": "attention.output.LayerNorm",
        "ln2": "output.LayerNorm",
        "q": "attention.self.query",
        "k": "attention.self.key",
        "v": "attention.self.value",
    },
    "gpt2": {
        "attn_out": "attn",
        "mlp_out": "mlp",
        "ln1": "ln_1",
        "ln2": "ln_2",
        "q": "attn.c_attn:q",
        "k": "attn.c_attn:k",
        "v": "attn.c_attn:v",
    },
    "gpt_neox": {
        "attn_out": "attention",
        "mlp_out": "mlp",
        "ln1": "input_layernorm",
        "ln2": "post_attention_layernorm",
        "q": "attention.query_key_value:q",
        "k": "attention.query_key_value:k",
        "v": "attention.query_key_value:v",
    },
    "llama": {
        "attn_out": "self_attn",
        "mlp_out": "mlp",
        "ln1": "input_layernorm",
        "ln2": "post_attention_layernorm",
        "q": "self_attn.q_proj",
        "k": "self_attn.k_proj",
        "v": "self_attn.v_proj",
    },
    "t5-encoder": {
        "attn_out": "layer.0.SelfAttention",
        "mlp_out": "layer.1.DenseReluDense",
        "ln1": "layer.0.layer_norm",
        "ln2": "layer.1.layer_norm",
        "q": "layer.0.SelfAttention.q",
        "k": "layer.0.SelfAttention.k",
        "v": "layer.0.SelfAttention.v",
    },
    "t5-decoder": {  # (layer.1 is the cross-attention, whose norm is not the block's second)
        "attn_out": "layer.0.SelfAttention",
        "mlp_out": "layer.2.DenseReluDense",
        "ln1": "layer.0.layer_norm",
        "q": "layer.0.SelfAttention.q",
        "k": "layer.0.SelfAttention.k",
        "v": "layer.0.SelfAttention.v",
    },
}
#: a config's model_type -> the family whose block layout it shares (T5: by the stack read)
FAMILY_OF_MODEL_TYPE = {
    "bert": "bert",
    "roberta": "bert",
    "gpt2": "gpt2",
    "gpt_neox": "gpt_neox",
    "llama": "llama",
    "mistral": "llama",
    "t5": "t5",
}
#: fused query-key-value projections: the path inside a block -> how its output (3D wide) splits:
#: ``thirds`` = [q | k | v] (GPT-2's c_attn), ``heads`` = per head [q_h | k_h | v_h] (GPT-NeoX's)
FUSED_QKV: dict[str, tuple[str, str]] = {
    "gpt2": ("attn.c_attn", "thirds"),
    "gpt_neox": ("attention.query_key_value", "heads"),
}
_GLOB = set("*?[")
_LISTED = 8  # module names an error lists


@dataclass(frozen=True)
class ModuleRequest:
    """One item of ``--modules``: a glob or an alias, the side and the fused part it asks for."""

    item: str
    pattern: str
    side: str = "out"
    part: str | None = None

    @property
    def alias(self) -> bool:
        return self.pattern in ALIASES

    @property
    def glob(self) -> bool:
        return bool(_GLOB & set(self.pattern))


@dataclass(frozen=True)
class ModuleCapture:
    """A module's output (or input, or part of a fused projection) stored as a layer of a run."""

    path: str  # in the base model
    side: str  # "out" | "in"
    part: str | None  # "q" | "k" | "v" of a fused projection
    type: str  # the module's class
    block: int | None  # its block's position in the stack's block list (None: outside the blocks)
    index: int  # the residual-stream index it belongs to: block k -> k + 1
    width: int  # the numbers per token it gives (of a fused projection's part: the part's)
    alias: str | None = None
    fused: str | None = None  # how a fused projection splits: "thirds" | "heads"
    heads: int | None = None
    tuple_output: bool = False  # the module returns a tuple: its first element is kept
    norm: bool = False  # a normalisation module
    order: int = 0  # when it is computed in the forward pass (the run stores in that order)


def parse_modules(spec) -> list[ModuleRequest]:
    """``--modules`` as written: comma-separated globs or aliases, a glob optionally followed by
    ``:in``, ``:out`` or (a fused projection) ``:q``, ``:k``, ``:v``. InputError (one line) for an
    empty list or item, an unknown suffix, or an alias with one."""
    items = [w.strip() for w in str(spec if spec is not None else "").split(",")]
    if not any(items) or not all(items):
        raise InputError(
            f"--modules {spec!r} has an empty item; give module names, globs or aliases, e.g. "
            "--modules '*.mlp,*.input_layernorm:in' or --modules attn_out,q"
        )
    out = []
    for item in items:
        pattern, _, suffix = item.partition(":")
        if suffix and pattern in ALIASES:
            raise InputError(
                f"--modules {item}: an alias takes no suffix ({pattern} names its side itself); "
                f"aliases: {', '.join(ALIASES)}"
            )
        if suffix and suffix not in (*SIDES, *QKV):
            raise InputError(
                f"--modules {item}: {suffix!r} is not a side; write PATTERN (the output), PATTERN:in "
                "(the input) or, for a fused query-key-value projection, PATTERN:q, :k or :v"
            )
        side = "in" if suffix == "in" else "out"
        out.append(ModuleRequest(item, pattern.strip(), side, suffix if suffix in QKV else None))
    return out


def model_family(lm) -> str | None:
    """The family of :data:`FAMILY_MODULES` whose layout the model has (None: none known)."""
    family = FAMILY_OF_MODEL_TYPE.get(str(lm.info.get("model_type") or ""))
    if family == "t5":
        return "t5-decoder" if lm.stack == "decoder" else "t5-encoder"
    return family


def base_module(lm):
    """The model the module paths are relative to: the base model under any head."""
    return getattr(lm.model, "base_model", None) or lm.model


@dataclass
class _Tree:
    """The stack's modules as the patterns see them."""

    paths: list[str]  # in named_modules order
    modules: dict  # path -> module
    prefix: str  # the checkpoint's base-model prefix ("gpt_neox"), or ""
    blocks: str | None  # the path of the stack's block list
    n_blocks: int
    family: str | None

    def block_of(self, path: str) -> int | None:
        if self.blocks is None or not path.startswith(self.blocks + "."):
            return None
        head = path[len(self.blocks) + 1 :].split(".", 1)[0]
        return int(head) if head.isdigit() else None

    def index_of(self, path: str, n_hidden_states: int) -> tuple[int | None, int]:
        """(block position, residual-stream index): block k -> k + 1; outside the blocks, 0 before
        them and the final norm's index (``n_hidden_states``) after them."""
        k = self.block_of(path)
        if k is not None:
            return k, k + 1
        if self.blocks is not None and self.paths.index(path) > self.paths.index(self.blocks):
            return None, n_hidden_states
        return None, 0

    def names(self, path: str) -> tuple[str, ...]:
        return (path, f"{self.prefix}.{path}") if self.prefix else (path,)


def _tree(lm) -> _Tree:
    from geomscope.model.probe import find_blocks

    base = base_module(lm)
    inside = {id(m) for m in lm.stack_module().modules()}
    named = [(p, m) for p, m in base.named_modules() if p and id(m) in inside]
    blocks = find_blocks(lm.stack_module(), lm.n_hidden_states - 1)
    blocks_path = next((p for p, m in named if m is blocks), None) if blocks is not None else None
    prefix = str(getattr(lm.model, "base_model_prefix", "") or "")
    return _Tree(
        paths=[p for p, _ in named],
        modules=dict(named),
        prefix=prefix,
        blocks=blocks_path,
        n_blocks=len(blocks) if blocks is not None else 0,
        family=model_family(lm),
    )


def resolve_modules(lm, spec) -> tuple[list[ModuleCapture], list[str]]:
    """(what ``--modules spec`` stores, in forward order; the modules globs matched but leave out,
    each with why). InputError (one line) for a pattern that matches nothing, an alias the model's
    family lacks, or an exactly named module that is not one vector per token."""
    requests = parse_modules(spec)
    tree = _tree(lm)
    wanted: dict[tuple, tuple[ModuleRequest, str | None]] = {}
    for req in requests:
        for path, side, part, alias in _expand(req, tree, lm):
            wanted.setdefault((path, side, part), (req, alias))
    seen = _probe_modules(lm, sorted({path for path, _, _ in wanted}))
    captures, skipped = [], []
    for (path, side, part), (req, alias) in wanted.items():
        cap, why = _capture(lm, tree, seen[path], path, side, part, alias)
        if cap is not None:
            captures.append(cap)
        elif req.glob:
            skipped.append(f"{path} ({why})")
        else:
            raise InputError(
                f"--modules {req.item}: {path} {why}; a run stores one vector per token and layer, "
                "so choose another module"
            )
    if not captures:
        raise InputError(
            f"--modules {spec}: no module it matches gives one vector per token "
            f"({'; '.join(skipped[:3])}); choose others"
        )
    captures.sort(key=lambda c: c.order)
    return captures, skipped


def _expand(req: ModuleRequest, tree: _Tree, lm) -> list[tuple[str, str, str | None, str | None]]:
    """``(path, side, part, alias)`` of every module one request names."""
    if req.pattern == ALL_NORMS:
        from geomscope.model.norms import is_norm

        norms = [p for p in tree.paths if is_norm(tree.modules[p])]
        if not norms:
            raise InputError(f"--modules norms: {lm.info['name']} has no norm module in its {lm.stack}")
        return [(p, side, None, ALL_NORMS) for p in norms for side in ("in", "out")]
    if req.alias:
        return _alias_modules(req.pattern, tree, lm)
    found = [p for p in tree.paths if any(fnmatch.fnmatchcase(n, req.pattern) for n in tree.names(p))]
    if not found:
        raise InputError(
            f"--modules {req.item}: no module of {lm.info['name']} ({lm.stack}) matches {req.pattern}; "
            f"it has {_examples(tree)}; {_aliases_text(tree)}"
        )
    if req.part is not None:
        fused = [p for p in found if _fused(tree, p) is not None]
        if not fused:
            raise InputError(
                f"--modules {req.item}: {found[0]} is not a fused query-key-value projection; "
                f":q, :k and :v split {_fused_text()}; name separate projections without a suffix"
            )
        found = fused
    return [(p, req.side, req.part, None) for p in found]


def _alias_modules(alias: str, tree: _Tree, lm) -> list[tuple[str, str, str | None, str | None]]:
    if tree.family is None or tree.blocks is None:
        raise InputError(
            f"--modules {alias}: aliases are known for the families {', '.join(FAMILY_MODULES)} "
            f"(model types {', '.join(FAMILY_OF_MODEL_TYPE)}); {lm.info['name']} is "
            f"{lm.info.get('model_type')}: name its modules by path (it has {_examples(tree)}), or use norms"
        )
    table = FAMILY_MODULES[tree.family]
    key, side = NORM_ALIASES.get(alias, (alias, "out"))
    if key not in table:
        raise InputError(f"--modules {alias}: the {tree.family} family has no {alias}; {_aliases_text(tree)}")
    rel, _, part = table[key].partition(":")
    out = []
    for k in range(tree.n_blocks):
        path = f"{tree.blocks}.{k}.{rel}"
        if path not in tree.modules:
            raise InputError(
                f"--modules {alias}: the {tree.family} layout puts it at {path}, which "
                f"{lm.info['name']} does not have; name its modules by path (it has {_examples(tree)})"
            )
        out.append((path, side, part or None, alias))
    return out


def _fused(tree: _Tree, path: str) -> str | None:
    """How the fused projection at ``path`` splits (:data:`FUSED_QKV`), or None."""
    fused = FUSED_QKV.get(tree.family or "")
    k = tree.block_of(path)
    if fused is None or k is None or path != f"{tree.blocks}.{k}.{fused[0]}":
        return None
    return fused[1]


def _fused_text() -> str:
    return ", ".join(f"{family}'s {path}" for family, (path, _) in FUSED_QKV.items())


def _examples(tree: _Tree) -> str:
    """A few of the stack's module paths: those of its first block, else its first ones."""
    first = f"{tree.blocks}.0." if tree.blocks else ""
    shown = [p for p in tree.paths if first and p.startswith(first)] or tree.paths
    more = len(tree.paths) - min(len(shown), _LISTED)
    return ", ".join(shown[:_LISTED]) + (f" and {more} more" if more > 0 else "")


def _aliases_text(tree: _Tree) -> str:
    if tree.family is None:
        return f"aliases: {ALL_NORMS} (no block layout known for this model type)"
    table = FAMILY_MODULES[tree.family]
    names = [a for a in ALIASES if NORM_ALIASES.get(a, (a,))[0] in table or a == ALL_NORMS]
    return f"aliases ({tree.family}): {', '.join(names)}"


def module_output(value):
    """The tensor a module's output holds: the output itself, or the first element of a tuple (or
    of a transformers ModelOutput); None when that is not a tensor."""
    import torch

    if torch.is_tensor(value):
        return value
    if hasattr(value, "to_tuple"):
        value = value.to_tuple()
    first = value[0] if isinstance(value, (tuple, list)) and value else None
    return first if torch.is_tensor(first) else None


def module_input(args, kwargs):
    """The tensor a module's input is: its first positional argument, else its ``hidden_states``
    keyword (transformers passes some blocks' inputs by keyword); None when neither is a tensor."""
    import torch

    if args and torch.is_tensor(args[0]):
        return args[0]
    h = (kwargs or {}).get("hidden_states")
    return h if torch.is_tensor(h) else None


def module_part(t, part: str | None, fused: str | None, heads: int | None):
    """``t`` (batch, tokens, 3D), the output of a fused query-key-value projection, cut to its
    ``part`` (q, k or v; (batch, tokens, D) concatenated over heads): ``thirds`` takes the part's
    third, ``heads`` the part's third of every head's slice (``t`` viewed as (batch, tokens, heads,
    3, d_head)). ``t`` itself without a part."""
    if part is None:
        return t
    j = QKV.index(part)
    if fused == "thirds":
        w = t.shape[-1] // 3
        return t[..., j * w : (j + 1) * w]
    b, n = t.shape[:2]
    return t.reshape(b, n, int(heads), 3, -1)[..., j, :].reshape(b, n, -1)


def _shape(t) -> tuple | None:
    """(shape, floating) of a tensor; None for anything else."""
    import torch

    return (tuple(t.shape), bool(t.is_floating_point())) if torch.is_tensor(t) else None


def _probe_modules(lm, paths: list[str]) -> dict[str, dict]:
    """Per module path: how often it runs in one forward pass of the probe batch, the shape of its
    input and output tensors, whether it returns a tuple, and when its input and output are
    computed (one clock for all, so that the run can store the modules in forward order)."""
    import itertools

    import torch

    from geomscope.model.probe import probe_batch

    base = base_module(lm)
    x = probe_batch(lm)
    seen = {
        p: {
            "calls": 0,
            "in": None,
            "out": None,
            "tuple": False,
            "start": None,
            "end": None,
            "batch": x.shape[:2],
        }
        for p in paths
    }
    clock = itertools.count()

    def before(path):
        def hook(_module, args, kwargs):
            s = seen[path]
            s["start"] = next(clock) if s["start"] is None else s["start"]
            s["in"] = _shape(module_input(args, kwargs))

        return hook

    def after(path):
        def hook(_module, _args, _kwargs, output):
            s = seen[path]
            s["calls"] += 1
            s["end"] = next(clock) if s["end"] is None else s["end"]
            s["out"], s["tuple"] = _shape(module_output(output)), not torch.is_tensor(output)

        return hook

    handles = []
    try:
        for p in paths:
            m = base.get_submodule(p)
            handles.append(m.register_forward_pre_hook(before(p), with_kwargs=True))
            handles.append(m.register_forward_hook(after(p), with_kwargs=True))
        with torch.inference_mode():
            lm.run_stack(x, torch.ones_like(x), False)
    finally:
        for h in handles:
            h.remove()
    return seen


def _capture(lm, tree: _Tree, seen: dict, path: str, side: str, part, alias):
    """(the ModuleCapture of ``path``'s ``side`` (and ``part``), None) when it is one vector per
    token (of any width) computed once per forward pass; else (None, why not)."""
    from geomscope.model.norms import is_norm

    what = "output" if side == "out" else "input"
    if seen["calls"] != 1:
        runs = "does not run" if not seen["calls"] else f"runs {seen['calls']} times"
        return None, f"{runs} in one forward pass of the {lm.stack}"
    got = seen[side]
    if got is None:
        return None, f"has no tensor as its {what}"
    shape, floating = got
    if not floating:
        return None, f"takes token ids as its {what}, not vectors"
    if len(shape) != 3 or shape[:2] != tuple(seen["batch"]):
        return None, f"gives its {what} as shape {list(shape)}, not one vector per token"
    fused = _fused(tree, path) if part else None
    heads = int(lm.model.config.num_attention_heads) if fused == "heads" else None
    if part and shape[-1] % (3 * (heads or 1)):
        return None, f"gives an output {shape[-1]} wide, which does not split into q, k and v"
    width = shape[-1] // 3 if part else shape[-1]
    if width < 1:
        return None, f"gives an {what} of no numbers per token"
    block, index = tree.index_of(path, lm.n_hidden_states)
    module = tree.modules[path]
    return ModuleCapture(
        path=path,
        side=side,
        part=part,
        type=type(module).__name__,
        block=block,
        index=index,
        width=int(width),
        alias=alias,
        fused=fused,
        heads=heads,
        tuple_output=seen["tuple"] and side == "out",
        norm=is_norm(module),
        order=3 * (seen["start"] if side == "in" else seen["end"]) + (QKV.index(part) if part else 0),
    ), None
