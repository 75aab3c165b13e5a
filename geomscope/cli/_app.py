"""The Typer application object; command modules register themselves on it.

Import rule: nothing here or in any ``geomscope.cli.*`` module may import torch,
transformers, h5py, matplotlib or scipy at module level -- import them inside the command body,
so ``geomscope --help`` stays fast.  ``tests/test_cli_help.py`` enforces it.
"""

from __future__ import annotations

import typer
from typer import core as _typer_core


def _conventional_arguments() -> None:
    """Show arguments as ``MODEL INPUT...`` in usage and help, as click and most CLIs do.

    Recent Typer prints required arguments as ``{MODEL}`` and appends a type (``<str>``,
    ``<list[str]>``) that the metavar and help already state; the README reference is generated from
    this help, so it must read conventionally and stay stable across Typer versions.
    """
    arg = getattr(_typer_core, "TyperArgument", None)
    if arg is None:
        return
    if hasattr(arg, "display_type_rich"):
        arg.display_type_rich = lambda self, ctx: None
    if hasattr(arg, "_usage_display_name"):

        def usage_name(self) -> str:
            name = self.display_name_raw if self.required else f"[{self.display_name_raw}]"
            return name + ("..." if self.nargs != 1 else "")

        arg._usage_display_name = usage_name


_conventional_arguments()

app = typer.Typer(
    name="geomscope",
    help=(
        "Embedding geometry of transformer language models: extract every layer's token "
        "activations, score IsoScore*, cosine similarity, spectra, outlier dimensions and "
        "intrinsic dimension per layer, plot them, and fine-tune with I-STAR / CosReg."
    ),
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion (bash, zsh, fish, PowerShell)
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain, conventional help: the README reference is generated from it
    context_settings={"help_option_names": ["-h", "--help"]},
)

state: dict = {"debug": False, "argv": None}


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
