"""Write a tiny random GPT-2 causal LM (2 blocks, width 64) with the bundled MiniLM's tokenizer.

Used by ``make gradients`` to show gradient geometry on a causal LM without downloading one: an
untrained model is the reference point where nothing has been learned yet. Usage:
``python docs/examples/tiny_causal_lm.py OUT_DIR``.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(out: str) -> None:
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from geomscope.model.names import bundled_minilm_dir

    dest = Path(out)
    if (dest / "config.json").exists():
        return
    tok = AutoTokenizer.from_pretrained(bundled_minilm_dir())
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tok),
        n_embd=64,
        n_layer=2,
        n_head=2,
        n_positions=256,
        bos_token_id=tok.cls_token_id,
        eos_token_id=tok.sep_token_id,
        pad_token_id=tok.pad_token_id,
    )
    GPT2LMHeadModel(config).save_pretrained(dest)
    tok.save_pretrained(dest)


if __name__ == "__main__":
    main(sys.argv[1])
