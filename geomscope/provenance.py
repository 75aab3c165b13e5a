"""What produced a result: the versions recorded in manifests, reports and training summaries."""

from __future__ import annotations


def package_versions() -> dict:
    """geomscope, torch and transformers versions (imports torch: call it inside commands only)."""
    import torch
    import transformers

    from geomscope import __version__

    return {"geomscope": __version__, "torch": torch.__version__, "transformers": transformers.__version__}
