"""The one message and progress convention of every command.

Every library entry point (``extract``, ``extract_revisions``, ``score``, ``export_run``,
``finetune``, ``run_sweep``) takes the same pair, with the same defaults:

- ``progress: bool = False``: a rich bar on stderr while it works;
- ``log: Log | None = None``: where its messages go, one line each (what it plans, what it wrote,
  what it warns about); ``None`` is :func:`silent`. The command line passes the pair
  :func:`command_output` makes of ``--quiet``: no bar and no notes with it, a bar only on a
  terminal, warnings always.

``with Progress(enabled) as bar: task = bar.add("extract", total, unit="docs", rate_unit="tok")``,
then ``task.advance(n, work=tokens)`` (``work`` drives the rate; default ``n``), ``task.skip(n)``
for work an earlier run did (counts toward the bar, not the rate), ``task.describe(text)`` and
``task.info(text)``; ``bar.print(line)`` prints above the bar.
"""

from __future__ import annotations

import time
from typing import Callable

#: a message sink: called with one line of text (no newline)
Log = Callable[[str], None]


def silent(msg: str) -> None:
    """The log that says nothing: the default of every library entry point."""


def log_to(log: Log | None) -> Log:
    """``log`` itself, or :func:`silent` for ``None``."""
    return silent if log is None else log


class Task:
    """One bar of a :class:`Progress`; every method is a no-op when the display is disabled."""

    def __init__(self, rich_progress, task_id, rate_unit: str | None):
        self._p, self._id, self._rate_unit = rich_progress, task_id, rate_unit
        self._work, self._t0 = 0, time.perf_counter()

    def advance(self, n: int = 1, *, work: int | None = None) -> None:
        if self._p is None:
            return
        self._work += n if work is None else work
        fields = {}
        if self._rate_unit:
            dt = max(1e-9, time.perf_counter() - self._t0)
            fields["rate"] = f"{self._work / dt:,.0f} {self._rate_unit}/s"
        self._p.update(self._id, advance=n, **fields)

    def skip(self, n: int) -> None:
        if self._p is not None:
            self._p.advance(self._id, n)

    def describe(self, text: str) -> None:
        if self._p is not None:
            self._p.update(self._id, description=_as_text(text))

    def info(self, text: str) -> None:
        if self._p is not None:
            self._p.update(self._id, info=_as_text(text))

    def complete(self) -> None:
        if self._p is not None:
            task = self._p.tasks[self._p.task_ids.index(self._id)]
            self._p.update(self._id, completed=task.total)


class Progress:
    """A rich progress display on stderr holding one or more :class:`Task` bars."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._p = None

    def __enter__(self) -> Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self._p = RichProgress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[unit]}"),
                TextColumn("{task.fields[rate]}"),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=False,
            )
            self._p.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._p is not None:
            self._p.stop()
            self._p = None

    def add(self, description: str, total: int, *, unit: str = "", rate_unit: str | None = None) -> Task:
        if self._p is None:
            return Task(None, None, None)
        task_id = self._p.add_task(_as_text(description), total=total, unit=unit, rate="", info="")
        return Task(self._p, task_id, rate_unit)

    def print(self, text: str) -> None:
        if self._p is not None:
            self._p.console.print(text, markup=False, highlight=False)


def _as_text(description: str) -> str:
    """A description (it names layers and files from the data) shown as itself: the bar renders it
    with markup on."""
    from geomscope.formatting import shown

    return shown(description)


def stderr_log(prefix: str = "") -> Log:
    """The command line's log: each message one line on stderr, soft-wrapped, every character of it
    shown as itself (:func:`geomscope.report.shown`), after ``prefix`` in yellow when one is given
    (``stderr_log("warning:")``)."""
    from rich.console import Console
    from rich.text import Text

    from geomscope.formatting import shown

    console = Console(stderr=True)

    def log(msg: str) -> None:
        text = Text(shown(msg, markup=False))
        if prefix:
            text = Text.assemble((prefix, "yellow"), " ", text)
        console.print(text, highlight=False, soft_wrap=True)

    return log


def command_output(quiet: bool, *, warns: bool = False, prefix: str = "") -> tuple[bool, Log]:
    """The ``(progress, log)`` pair every command passes its library entry point: the one meaning of
    ``--quiet``, which hides the bar and the notes and never a warning.

    ``progress``: a bar when stderr is a terminal and not ``--quiet`` (into a file or a pipe a bar
    is a wall of redrawn lines). ``log`` (:func:`stderr_log`, after ``prefix``): the notes of what a
    command plans and wrote, :func:`silent` with ``--quiet``; ``warns``: the entry point's log
    carries only what must not pass unsaid, kept with ``--quiet`` (score's warnings; finetune's
    changes to the model it was given: a new head, a pad token, a clamped ``--max-length``)."""
    import sys

    progress = not quiet and sys.stderr.isatty()
    return progress, (silent if quiet and not warns else stderr_log(prefix))
