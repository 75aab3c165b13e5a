"""A rich progress bar on stderr: documents done / total, tokens per second, elapsed, ETA."""

from __future__ import annotations

import time


class Progress:
    """``with Progress(total_docs, enabled) as p: p.advance(docs, tokens)``; silent when disabled."""

    def __init__(self, total_docs: int, enabled: bool, description: str = "extract"):
        self.enabled = enabled
        self.total = total_docs
        self.tokens = 0
        self.t0 = time.perf_counter()
        self._p = None
        self._task = None
        if enabled:
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
                TextColumn("docs"),
                TextColumn("{task.fields[rate]} tok/s"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=False,
            )
            self._task = self._p.add_task(description, total=total_docs, rate="-")

    def __enter__(self) -> Progress:
        if self._p is not None:
            self._p.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._p is not None:
            self._p.stop()

    def skip(self, docs: int) -> None:
        """Documents already done by an earlier run (they count toward the bar, not the rate)."""
        if self._p is not None:
            self._p.advance(self._task, docs)

    def advance(self, docs: int, tokens: int) -> None:
        self.tokens += tokens
        if self._p is not None:
            dt = max(1e-9, time.perf_counter() - self.t0)
            self._p.update(self._task, advance=docs, rate=f"{self.tokens / dt:,.0f}")
