"""Fine-tuning with geometry regularisers: I-STAR (IsoScore*) and CosReg.

Public API::

    from geomscope.train import FinetuneConfig, finetune
    summary = finetune(FinetuneConfig(model="path/to/ckpt", train="train.csv", eval="dev.csv", out="run"))

See :mod:`geomscope.train.loop` for the outputs and :mod:`geomscope.train.regularizers` for the
exact penalties.  Importing this package imports neither torch nor transformers.
"""

from __future__ import annotations

from geomscope.train.loop import FinetuneConfig, finetune

__all__ = ["FinetuneConfig", "finetune"]
