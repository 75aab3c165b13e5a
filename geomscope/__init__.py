"""geomscope: embedding geometry of transformer language models."""

__version__ = "0.1.0"
