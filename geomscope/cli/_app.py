"""The Typer application object; command modules register themselves on it.

Import rule: nothing here or in any ``geomscope.cli.*`` module may import torch,
transformers, h5py, matplotlib or scipy at module level -- import them inside the command body,
so ``geomscope --help`` stays fast.  ``tests/test_cli_help.py`` enforces it.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="geomscope",
    help=(
        "Embedding geometry of transformer language models: extract every layer's token "
        "activations, score IsoScore*, cosine similarity, spectra, outlier dimensions and "
        "intrinsic dimension per layer, plot them, and fine-tune with I-STAR / CosReg."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)

state = {"debug": False}


def _version(value: bool) -> None:
    if value:
        from geomscope import __version__

        typer.echo(f"geomscope {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks for errors."),
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    state["debug"] = debug
