"""The one progress display of every command: a rich bar on stderr, a no-op when disabled.

``with Progress(enabled) as bar: task = bar.add("extract", total, unit="docs", rate_unit="tok")``,
then ``task.advance(n, work=tokens)`` (``work`` drives the rate; default ``n``), ``task.skip(n)``
for work an earlier run did (counts toward the bar, not the rate), ``task.describe(text)`` and
``task.info(text)``; ``bar.print(line)`` prints above the bar.
"""

from __future__ import annotations

import time


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
    from geomscope.report import shown

    return shown(description)
