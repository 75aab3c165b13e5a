"""Rich progress bar for fine-tuning (stderr; disabled on non-main ranks and with --quiet)."""

from __future__ import annotations


class TrainProgress:
    """Steps bar with the running loss / batch IsoScore*, plus one line per epoch evaluation."""

    def __init__(self, total: int, enabled: bool = True):
        self.enabled = enabled
        self.total = total
        self._p = None
        self._task = None

    def __enter__(self):
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TaskProgressColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._console = Console(stderr=True)
            self._p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                               TaskProgressColumn(show_speed=True), TextColumn("{task.fields[info]}"),
                               TimeElapsedColumn(), TimeRemainingColumn(), console=self._console)
            self._p.__enter__()
            self._task = self._p.add_task("training", total=self.total, info="")
        return self

    def __exit__(self, *exc):
        if self._p is not None:
            self._p.__exit__(*exc)
        return False

    def status(self, text: str) -> None:
        if self._p is not None:
            self._p.update(self._task, description=text)

    def advance(self, rec: dict) -> None:
        if self._p is None:
            return
        info = f"loss {rec['loss']:.4f}"
        if rec.get("isoscore_star") is not None:
            info += f"  IsoScore* {rec['isoscore_star']:.4f}"
        self._p.update(self._task, advance=1, info=info)

    def log_eval(self, ev: dict) -> None:
        if self._p is None:
            return
        iso = ev.get("isoscore_star")
        cos = ev.get("avgcos")
        self._p.console.print(
            f"epoch {ev['epoch']}: accuracy {ev['accuracy']:.4f}  macro-F1 {ev['macro_f1']:.4f}  "
            f"eval IsoScore* {'n/a' if iso is None else f'{iso:.4f}'}  "
            f"avg cosine {'n/a' if cos is None else f'{cos:.4f}'}"
        )
