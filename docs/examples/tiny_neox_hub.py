"""Write an offline Hugging Face hub cache holding two sizes of a tiny GPT-NeoX (the Pythia layout),
each at three training revisions, as Pythia's checkpoints are revisions of one hub repository.

``tiny/neox-w32`` (width 32, 2 blocks) and ``tiny/neox-w64`` (width 64, 3 blocks) share a
word-level tokenizer fitted to ``sample_data/sentences.txt``. Each starts from its seeded random
weights (revision ``step0``) and is trained on next-token prediction over those sentences (AdamW,
learning rate 3e-3, batches of 16 sentences cut to 32 tokens, padding out of the loss); revisions
``step10`` and ``step100`` are its weights after 10 and 100 steps. Usage:
``python docs/examples/tiny_neox_hub.py CACHE_DIR``; then, with ``HF_HUB_CACHE=CACHE_DIR`` and
``HF_HUB_OFFLINE=1``, ``extract tiny/neox-w32 ... --revisions step0,step10,step100`` reads them.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEXT = ROOT / "sample_data" / "sentences.txt"
SIZES = {"tiny/neox-w32": (32, 2), "tiny/neox-w64": (64, 3)}
SAVED = (0, 10, 100)
EOS = "<|endoftext|>"


def tokenizer():
    """A word-level tokenizer of the sentences' words and punctuation, with an end-of-text token."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import WordLevel
    from tokenizers.trainers import WordLevelTrainer
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(WordLevel(unk_token="<unk>"))
    tk.normalizer = normalizers.Lowercase()
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train([str(TEXT)], WordLevelTrainer(special_tokens=[EOS, "<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=EOS, eos_token=EOS, unk_token="<unk>")


def batches(tok, steps: int, size: int = 16, length: int = 32):
    """``steps`` seeded batches of ``size`` sentences: (input ids, attention mask, labels)."""
    import torch

    lines = [ln for ln in TEXT.read_text(encoding="utf-8").splitlines() if ln.strip()]
    ids = [tok(ln)["input_ids"][:length] for ln in lines]
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        pick = torch.randint(len(ids), (size,), generator=gen).tolist()
        width = max(len(ids[i]) for i in pick)
        x = torch.zeros(size, width, dtype=torch.long)
        mask = torch.zeros(size, width, dtype=torch.long)
        for row, i in enumerate(pick):
            x[row, : len(ids[i])] = torch.tensor(ids[i])
            mask[row, : len(ids[i])] = 1
        yield x, mask, x.masked_fill(mask == 0, -100)


def save_revision(model, tok, cache: Path, repo: str, step: int) -> None:
    """The weights as revision ``step<N>`` of ``repo`` in the hub cache's layout."""
    entry = cache / ("models--" + repo.replace("/", "--"))
    commit = hashlib.sha1(f"{repo}@step{step}".encode()).hexdigest()
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        snap = entry / "snapshots" / commit
        shutil.rmtree(snap, ignore_errors=True)
        shutil.copytree(tmp, snap)
    (entry / "refs").mkdir(parents=True, exist_ok=True)
    (entry / "refs" / f"step{step}").write_text(commit)


def train(repo: str, width: int, blocks: int, tok, cache: Path) -> None:
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=len(tok),
        hidden_size=width,
        num_hidden_layers=blocks,
        num_attention_heads=width // 16,
        intermediate_size=4 * width,
        max_position_embeddings=64,
        rotary_pct=0.25,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model = GPTNeoXForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    save_revision(model.eval(), tok, cache, repo, 0)
    model.train()
    for step, (x, mask, labels) in enumerate(batches(tok, max(SAVED)), 1):
        loss = model(input_ids=x, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step in SAVED:
            save_revision(model.eval(), tok, cache, repo, step)
            model.train()


def main(out: str) -> None:
    cache = Path(out)
    if all(
        (cache / ("models--" + r.replace("/", "--")) / "refs" / f"step{max(SAVED)}").exists() for r in SIZES
    ):
        return
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)  # models this small train fastest on one thread
    hf_logging.disable_progress_bar()
    tok = tokenizer()
    for repo, (width, blocks) in SIZES.items():
        train(repo, width, blocks, tok, cache)


if __name__ == "__main__":
    main(sys.argv[1])
