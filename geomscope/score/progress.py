"""A rich progress bar on stderr (rows, rate, ETA), one bar per pass; a no-op when disabled."""

from __future__ import annotations

from contextlib import contextmanager


class Progress:
    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self._p = None

    def __enter__(self) -> Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TaskProgressColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self._p = RichProgress(
                TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
                MofNCompleteColumn(), TextColumn("rows"),
                TextColumn("{task.fields[rate]}"),
                TimeElapsedColumn(), TimeRemainingColumn(),
                console=Console(stderr=True), transient=False,
            )
            self._p.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._p is not None:
            self._p.__exit__(*exc)
            self._p = None

    @contextmanager
    def task(self, description: str, total: int):
        if self._p is None:
            yield None
            return
        import time

        tid = self._p.add_task(description, total=total, rate="")
        t0 = time.perf_counter()
        done = [0]

        def advance(n: int) -> None:
            done[0] += n
            dt = time.perf_counter() - t0
            rate = f"{done[0] / dt:,.0f} rows/s" if dt > 0 else ""
            self._p.update(tid, advance=n, rate=rate)

        try:
            yield advance
        finally:
            self._p.update(tid, completed=total)
