"""Taps on the modules ``extract --modules`` stores: forward hooks that hand over what each module
gives in one forward pass (which modules, and what their outputs are: geomscope/model/modules.py).

A tap hands its module's tensor (its output, or its first tuple element, or its input) to a
callback as soon as the module has computed it: the activation capture casts and gathers the
real-token rows at once (so a later in-place change of the tensor cannot reach them, and no
module's full padded output outlives its hook), and the gradient capture keeps the tensor itself,
a node of the autograd graph. A fused query-key-value projection is tapped once; its q, k and v
layers are cut from the one tensor (:meth:`ModuleTaps.part`), and their gradients from the
gradient of that tensor.
"""

from __future__ import annotations

from collections.abc import Callable

from geomscope.errors import InputError


class ModuleTaps:
    """The module layers of a run (identity entries of kind ``module``) and their hooks."""

    def __init__(self, lm, layers: list[dict]):
        from geomscope.model.modules import base_module

        self.layers = [la for la in layers if la.get("kind") == "module"]
        self.names = [la["name"] for la in self.layers]
        self._base = base_module(lm)
        self._by_name = {la["name"]: la for la in self.layers}
        # one tap per (module, side): the layers it feeds (q, k and v share a fused projection's)
        self.taps: dict[tuple[str, str], list[str]] = {}
        for la in self.layers:
            self.taps.setdefault((la["module"], la["side"]), []).append(la["name"])

    def __bool__(self) -> bool:
        return bool(self.layers)

    def attach(self, take: Callable[[tuple[str, str], object], None]) -> Callable[[], None]:
        """Hook every tapped module: ``take((module, side), tensor)`` once per forward pass. Returns
        the function that removes the hooks and checks that each tap fired exactly once."""
        from geomscope.model.modules import module_input, module_output

        fired = dict.fromkeys(self.taps, 0)
        handles = []

        def tap(key, tensor):
            fired[key] += 1
            take(key, tensor)

        for key in self.taps:
            module = self._base.get_submodule(key[0])
            if key[1] == "in":
                hook = _input_hook(key, tap, module_input)
                handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
            else:
                hook = _output_hook(key, tap, module_output)
                handles.append(module.register_forward_hook(hook, with_kwargs=True))

        def detach() -> None:
            for h in handles:
                h.remove()
            wrong = [(key, n) for key, n in fired.items() if n != 1]
            if wrong:
                (path, side), n = wrong[0]
                raise InputError(
                    f"module {path} ({side}) ran {n} times in this forward pass, once when the run was "
                    "planned; a module whose calls depend on the text cannot be stored (--modules)"
                )

        return detach

    def part(self, name: str, tensor):
        """Layer ``name``'s rows from its tap's tensor: the tensor, or its q, k or v."""
        from geomscope.model.modules import module_part

        la = self._by_name[name]
        return module_part(tensor, la.get("part"), la.get("fused"), la.get("heads"))

    def key(self, name: str) -> tuple[str, str]:
        la = self._by_name[name]
        return la["module"], la["side"]


def _input_hook(key, tap, module_input):
    def hook(_module, args, kwargs):
        tensor = module_input(args, kwargs)
        if tensor is not None:
            tap(key, tensor)

    return hook


def _output_hook(key, tap, module_output):
    def hook(_module, _args, _kwargs, output):
        tensor = module_output(output)
        if tensor is not None:
            tap(key, tensor)

    return hook
