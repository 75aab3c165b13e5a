"""The ``--layers`` grammar, one for every command, and the names of layers.

A selection is read against the layers a thing has, each a name and an index: a model's hidden
states at extract and finetune (:func:`model_layers`), a run's stored layers at score and export
(:func:`stored_layers`), a report's layers at plot (:func:`listed_layers`). Index ``i`` counts the
residual stream: 0 is the embedding output, ``i >= 1`` the output of block ``i``; ``final_norm``, the
output of the model's final norm, has index N + 1 after the last block N, and a gradient layer
``<name>.grad`` shares its layer's index. A module's layer (``extract --modules``: its path,
:func:`module_layer_name`) has the index of its block's output: block k's modules (``layers.3.mlp``
is in block 3 of 0, 1, 2, ...) sit at index k + 1 beside ``layer_{k+1}``; a module before the blocks
at 0, one after them at N + 1 (outside the residual stream, as ``final_norm`` is). A selection is
``all`` (or nothing given), or a comma list whose items are, each tried in this order:

- a name the thing has (``layer_06``, ``final_norm``, ``layer_06.grad``): that layer;
- ``all``: every layer; ``blocks``: every layer at index 1 or more except ``final_norm``, the
  modules after the last block and their gradients (the embedding output and the final norm left
  out: finetune's I-STAR default). Where a
  thing has no embedding layer (a run extracted without layer 0, a report of array files whose
  indices are the arrays' positions) ``blocks`` still leaves out whatever sits at index 0;
- an index ``i``: every layer at index ``i`` (an activation and its gradient in a gradient run);
  a negative index counts back over the residual stream (``-1``: the last block, never
  ``final_norm``);
- a range ``a-b``: every layer at an index from ``a`` to ``b``, both ends included; an end may be
  negative (``-3--1``) or a ``layer_NN`` name (``layer_02-layer_04``);
- ``layer_N`` (any zero padding, ``layer_6`` for ``layer_06``): the activation layers at index N;
  ``layer_N.grad`` their gradients.

The selection comes back in the thing's own order, each layer once. Anything it cannot place is an
:class:`~geomscope.errors.InputError` of one line that says what is wrong, what the thing has and an
example. This module imports nothing heavy, so the CLI can check a selection before loading anything.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from geomscope.errors import InputError
from geomscope.options import comma_items

#: the name of a layer's gradient rows (extract --capture gradients): ``layer_06.grad``
GRAD_SUFFIX = ".grad"
#: the layer that holds the output of the model's final norm (index N + 1)
FINAL_NORM_LAYER = "final_norm"
#: the suffix of a layer that holds a module's input (``extract --modules PATTERN:in``)
MODULE_INPUT = ":in"
#: the words a selection may use besides names, indices and ranges
LAYER_KEYWORDS = ("all", "blocks")

_INDEX = re.compile(r"-?\d+")
_NUMBERED = re.compile(r"(?i)layer_0*(\d+)")
_RANGE = re.compile(r"(?i)(-?\d+|layer_\d+)\s*-\s*(-?\d+|layer_\d+)")
_LISTED = 12  # names an error lists before it says how many more there are


def is_gradient(name: str) -> bool:
    """A layer of gradient rows (``layer_06.grad``, extract --capture gradients)."""
    return str(name).endswith(GRAD_SUFFIX)


def activation_name(name: str) -> str:
    """The activation layer a gradient layer belongs to (``layer_06.grad`` -> ``layer_06``); any
    other name as it is."""
    name = str(name)
    return name[: -len(GRAD_SUFFIX)] if is_gradient(name) else name


def gradient_name(name: str) -> str:
    """The gradient layer of an activation layer (``layer_06`` -> ``layer_06.grad``)."""
    return activation_name(name) + GRAD_SUFFIX


def layer_name(index: int, n_hidden_states: int) -> str:
    """The stored name of hidden state ``index``: ``layer_`` and the index padded to the width of the
    last one, at least 2 digits (``layer_06``), so that names sort as their indices do."""
    width = max(2, len(str(n_hidden_states - 1)))
    return f"layer_{index:0{width}d}"


def module_layer_name(path: str, side: str = "out", part: str | None = None) -> str:
    """The stored name of a module's layer: its path (``layers.3.mlp``), ``:in`` after it for its
    input (``layers.3.input_layernorm:in``), ``:q``/``:k``/``:v`` for a part of a fused projection
    (``h.3.attn.c_attn:q``)."""
    return str(path) + (MODULE_INPUT if side == "in" else "") + (f":{part}" if part else "")


def layer_number(name: str) -> int | None:
    """The index N of a hidden state's name ``layer_N`` (any zero padding, any case: ``layer_06``,
    ``layer_6``), None for any other name (``final_norm``, a module's path, ``layer_06.grad``)."""
    m = _NUMBERED.fullmatch(str(name))
    return int(m.group(1)) if m else None


def is_hidden_state(name: str) -> bool:
    """A hidden state's activation layer ``layer_N`` (not its gradient, a module or ``final_norm``)."""
    return layer_number(name) is not None


def is_final_norm(name: str) -> bool:
    """The final norm's output or its gradient: outside the residual stream's index arithmetic."""
    return activation_name(name) == FINAL_NORM_LAYER


@dataclass(frozen=True)
class Layer:
    """One layer a thing has: its name, its index and its place in the thing's list."""

    name: str
    index: int
    position: int
    #: counted in the residual stream's index arithmetic (negative indices, ``blocks``): not a
    #: module after the last block (``final_norm`` is left out by its name)
    stream: bool = True


@dataclass(frozen=True)
class Layers:
    """The layers a selection is read against, and how its errors speak of them.

    ``where``: the thing in an error (``this model``, ``this run``, a report's name); ``model``: the
    layers are a model's hidden states, every index from 0 to the last one (a missing index is then
    out of range rather than absent).
    """

    layers: tuple[Layer, ...]
    where: str
    model: bool = False
    option: str = "--layers"

    @property
    def names(self) -> list[str]:
        return [la.name for la in self.layers]


def model_layers(n_hidden_states: int, final_norm: bool = False, option: str = "--layers") -> Layers:
    """A model's hidden states ``layer_00`` .. ``layer_{n-1}``, and ``final_norm`` (index n) when the
    model's final norm is stored as a layer of its own."""
    n = int(n_hidden_states)
    layers = [Layer(layer_name(i, n), i, i) for i in range(n)]
    if final_norm:
        layers.append(Layer(FINAL_NORM_LAYER, n, n))
    return Layers(tuple(layers), "this model", model=True, option=option)


def stored_layers(entries: Iterable[dict], where: str = "this run", option: str = "--layers") -> Layers:
    """The layers of a run's identity (``{"name", "index", ...}`` each); a layer without an integer
    index takes its position in the list."""
    layers = []
    for pos, entry in enumerate(entries):
        index = entry.get("index")
        whole = isinstance(index, int) and not isinstance(index, bool)
        after_blocks = entry.get("kind") == "module" and entry.get("block") is None and whole and index > 0
        layers.append(Layer(str(entry["name"]), index if whole else pos, pos, stream=not after_blocks))
    return Layers(tuple(layers), where, option=option)


def listed_layers(
    names: Sequence[str], indices: Sequence[int], where: str, option: str = "--layers"
) -> Layers:
    """Layers given as parallel lists of names and indices (a report's layer entries)."""
    return Layers(
        tuple(Layer(str(n), int(i), p) for p, (n, i) in enumerate(zip(names, indices, strict=True))),
        where,
        option=option,
    )


def layer_items(spec) -> list[str]:
    """The items of a selection as text (:func:`~geomscope.options.comma_items`): a comma-separated
    string or a list of them (a list's items may hold commas too, as the CLI's repeated options do),
    stripped, blanks dropped; an index given as a number is its text."""
    raw = spec if spec is None or isinstance(spec, (str, int)) else list(spec)
    return [str(item) for item in comma_items(raw)]


def names_layer(spec, name: str) -> bool:
    """Whether a selection names ``name`` (in any case) as one of its items (``final_norm`` at
    extract, where a model without a separable final norm is refused with the reason)."""
    return any(item.lower() == name.lower() for item in layer_items(spec))


def select_layers(spec, things: Layers) -> list[Layer]:
    """The layers a selection picks, in the thing's order, each once (module docstring: the grammar).

    ``None``, a blank string or an empty list is ``all``; a selection of separators only (``","``)
    picks nothing and is refused.
    """
    items = layer_items(spec)
    if not items:
        blank = spec is None or (str(spec).strip() == "" if isinstance(spec, str) else not list(spec))
        if blank:
            return list(things.layers)
        shown = spec if isinstance(spec, str) else ",".join(map(str, spec))
        raise _refused(things, f"{shown!r} selects no layer")
    picked: set[int] = set()
    for item in items:
        picked.update(la.position for la in _item_layers(item, things))
    if not picked:
        raise _refused(things, f"{','.join(items)!r} selects no layer")
    return [la for la in things.layers if la.position in picked]


def select_names(spec, things: Layers) -> list[str]:
    """The names of :func:`select_layers`'s layers."""
    return [la.name for la in select_layers(spec, things)]


def parse_layers(spec, n_hidden_states: int) -> list[int]:
    """The hidden-state indices a selection picks from a model of ``n_hidden_states`` (no
    ``final_norm``): extract's read layers and finetune's I-STAR layers, sorted."""
    return [la.index for la in select_layers(spec, model_layers(n_hidden_states))]


def _item_layers(item: str, things: Layers) -> list[Layer]:
    """The layers one item of a selection picks (an empty list for a range over absent indices)."""
    named = [la for la in things.layers if la.name == item]
    if named:
        return named
    word = item.lower()
    if word == "all":
        return list(things.layers)
    if word == "blocks":
        return [la for la in things.layers if la.index >= 1 and _in_stream(la)]
    if _INDEX.fullmatch(item):
        return _at_index(_index(item, things), item, things)
    m = _RANGE.fullmatch(item)
    if m:
        lo, hi = _end(m.group(1), things), _end(m.group(2), things)
        if lo > hi:
            raise _refused(things, f"range {item} runs backwards; write it low-high, e.g. {hi}-{lo}")
        return [la for la in things.layers if lo <= la.index <= hi]
    number = layer_number(activation_name(item))
    if number is not None:
        grad = is_gradient(item)
        at = [la for la in things.layers if la.index == number and is_gradient(la.name) == grad]
        if at:
            return at
    folded = [la for la in things.layers if la.name.lower() == word]
    if folded:
        return folded
    raise _refused(
        things, _absent(f"layer {item!r}", things, index=number is not None, grad=is_gradient(item))
    )


def _index(item: str, things: Layers) -> int:
    """An index as written, a negative one counted back over the residual stream's indices."""
    i = int(item)
    if i >= 0:
        return i
    stream = sorted({la.index for la in things.layers if _in_stream(la)})
    if -i > len(stream):
        raise _refused(things, _absent(f"layer {i}", things, index=True))
    return stream[i]


def _at_index(i: int, item: str, things: Layers) -> list[Layer]:
    at = [la for la in things.layers if la.index == i]
    if not at:
        raise _refused(things, _absent(f"layer {item}", things, index=True))
    return at


def _end(end: str, things: Layers) -> int:
    """A range's end as an index, within the thing's indices (a range may pass over absent ones)."""
    number = layer_number(end)
    i = number if number is not None else _index(end, things)
    indices = [la.index for la in things.layers]
    if not indices or not min(indices) <= i <= max(indices):
        raise _refused(things, _absent(f"layer {end}", things, index=True))
    return i


def _absent(what: str, things: Layers, index: bool, grad: bool = False) -> str:
    if grad and not any(is_gradient(n) for n in things.names):
        return f"{what} is not in {things.where}, which has no gradient layers (extract --capture gradients)"
    if things.model and index:
        return f"{what} is out of range"
    if things.model:
        return f"{what} is not in {things.where} (not a layer index or a name it has)"
    return f"{what} is not in {things.where}"


def _refused(things: Layers, problem: str) -> InputError:
    """One line: the problem, what the thing has, and an example selection."""
    return InputError(
        f"{things.option}: {problem}; {_summary(things)}; use e.g. {things.option} {_example(things)}"
    )


def _summary(things: Layers) -> str:
    names = things.names
    if things.model:
        n = sum(not is_final_norm(x) for x in names)
        norm = f", {n} = final_norm" if FINAL_NORM_LAYER in names else ""
        return (
            f"{things.where} has {n} hidden states: 0 = embeddings, 1..{n - 1} = blocks{norm} "
            "(negative indices count back from the last block)"
        )
    if not names:
        return f"{things.where} has no layers"
    shown = ", ".join(names[:_LISTED]) + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED else "")
    return f"{things.where} has {shown}"


def _in_stream(layer: Layer) -> bool:
    """Whether a layer counts in the residual stream's index arithmetic."""
    return layer.stream and not is_final_norm(layer.name)


def _example(things: Layers) -> str:
    stream = sorted({la.index for la in things.layers if _in_stream(la)})
    if not stream:
        return "all"
    lo, hi = stream[0], stream[-1]
    if things.model:
        return f"all, blocks, {lo},{hi} or {min(lo + 1, hi)}-{hi}"
    return f"all, {things.layers[0].name}, {lo},{hi}, {lo}-{hi} or -1"


#: --layers of the commands that read a run or a report (score, export, plot): this module's grammar
STORED_LAYERS_HELP = (
    "Only these layers: names, indices (-1 = last block), ranges a-b, all, blocks, final_norm, "
    "<name>.grad (comma list)."
)
