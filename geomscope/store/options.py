"""``InspectOptions``: what ``inspect`` checks of a run besides describing it, declared once
(:mod:`geomscope.options`): ``geomscope inspect --help`` is built from these fields, and
:func:`geomscope.store.describe.describe_run` takes the same object. A light module: no h5py."""

from __future__ import annotations

from dataclasses import dataclass

from geomscope.options import Flag, check, option


@dataclass(frozen=True)
class InspectOptions:
    """What ``inspect`` checks, declared once (:mod:`geomscope.options`)."""

    verify: bool = option(
        False,
        Flag(),
        "Also check every shard's size and checksum against the manifest (reads every byte).",
    )

    def validate(self) -> InspectOptions:
        """``self`` when every option meets its declaration; OptionError (one line) naming the
        option otherwise."""
        check(self)
        return self
