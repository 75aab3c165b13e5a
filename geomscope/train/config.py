"""The options of ``geomscope finetune`` (:class:`FinetuneConfig`), their one-line checks, and what of
them a run records (``run.json``) and must match to resume (the fingerprint).

Training options (each left out of ``run.json`` and the resume fingerprint while at its default, so
that a checkpoint whose run.json lacks the key resumes as one at the default):

* ``weight_decay``: AdamW weight decay W on the weights, none on biases and LayerNorm weights (as
  transformers' Trainer groups them).  Unset (the default) keeps torch's AdamW default, 0.01 on every
  parameter, as the released I-STAR settings do.
* ``scheduler`` (constant | linear | cosine) and ``warmup`` (a fraction of the optimiser steps,
  rounded up, as transformers' ``warmup_ratio``): transformers' ``get_scheduler``, stepped once per
  optimiser step; its state is in the checkpoint and ``lr`` in steps.jsonl is the rate the step used.
  A schedule depends on the run's length, so ``epochs`` joins the resume fingerprint.
* ``grad_accum`` N: every optimiser step consumes N micro-batches of ``batch_size`` per process (so
  ``batch_size * N * world`` examples), gradients summed before one update; the task loss is the
  mean over the whole global batch, exactly as without accumulation.  The I-STAR / CosReg penalty
  is taken per micro-batch (each micro-batch's own covariance, C0 unchanged) and the step's
  gradient is the mean of the N micro-batch penalty gradients: a covariance over the accumulated
  batch would need every micro-batch's hidden states (and their graphs) alive at once, which is what
  accumulation exists to avoid.  ``penalty`` / ``isoscore_star`` in steps.jsonl are the means over
  the step's micro-batches.  With N = 1 nothing changes.
* ``max_grad_norm``: the global L2 norm of the step's gradient (task loss and penalty, after DDP's
  averaging, over every parameter) clipped to this value before the update, by Accelerate's
  ``clip_grad_norm_`` (which unscales fp16 gradients first and works on FSDP shards); ``grad_norm``
  in steps.jsonl is the norm before clipping.  Unset: no clipping, and no ``grad_norm``.
* ``gradient_checkpointing``: transformers' activation checkpointing (non-reentrant, so dropout
  replays the same masks): the same gradients for less memory, so it is not in the fingerprint.
* ``lora`` R (``lora_alpha``, ``lora_target``): low-rank adapters, :mod:`geomscope.train.lora`.
* ``report_to``: an experiment tracker for the step and eval records, :mod:`geomscope.train.tracking`.
* ``lm_batching`` (pack | pad): the rows of ``--task causal-lm``, :mod:`geomscope.train.causal_lm`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from geomscope.choices import (
    DEFAULT_CONTROLS,
    DEFAULT_ZETA,
    LM_BATCHING,
    PENALTY_PRECISIONS,
    PRECISIONS,
    REGULARISERS,
    SCHEDULERS,
    TASKS,
    TRACKERS,
)
from geomscope.devices import DEVICE_HELP
from geomscope.errors import InputError
from geomscope.fileio import input_digest
from geomscope.options import (
    POSITIVE_INT,
    UNIT_INTERVAL,
    Choice,
    CommaList,
    Device,
    Flag,
    Interval,
    Layers,
    Text,
    check,
    check_value,
    choice_metavar,
    default_of,
    option,
)

#: the training options whose absence from run.json means their default (their declared defaults,
#: which a test holds them to): recorded in run.json and the resume fingerprint only when set to
#: something else, so that a run.json without one of them resumes as a run at its default
NEW_DEFAULTS = {
    "weight_decay": None,
    "scheduler": "constant",
    "warmup": 0.0,
    "grad_accum": 1,
    "max_grad_norm": None,
    "gradient_checkpointing": False,
    "lora": None,
    "lora_alpha": None,
    "lora_target": "q,v",
    "report_to": "none",
    "lm_batching": "pack",
    "geometry_controls": 20,
}
#: none of them changes what is learnt
_NOT_FINGERPRINTED = ("report_to", "gradient_checkpointing", "geometry_controls")
# options that must match to resume a run (epochs may grow; device and verbosity may change)
_FINGERPRINT = (
    "model",
    "train",
    "eval",
    "text_field",
    "text_field_2",
    "label_field",
    "reg",
    "lam",
    "zeta",
    "c0_points",
    "layers",
    "lr",
    "batch_size",
    "max_length",
    "seed",
    "precision",
    "include_padding",
    "penalty_precision",
    "task",
)


#: the largest --seed + 1: the seed is mixed with the epoch (data.epoch_order) and the rank (dropout)
#: into torch generator seeds, which must stay below 2**64; NumPy takes seeds below 2**32
SEED_LIMIT = 2**32
#: finetune's seeds: below :data:`SEED_LIMIT`
FINETUNE_SEED = Interval(
    whole=True, low=0, high=SEED_LIMIT - 1, words=f"a whole number from 0 to {SEED_LIMIT - 1}"
)
_POSITIVE = Interval(whole=False, low=0, open_low=True, words="a positive number")
#: --geometry-rank: whole numbers >= 1, however written (8,32 or a list of them)
_RANKS = CommaList("whole numbers >= 1 (e.g. 8,32)", POSITIVE_INT, int, nonempty=True)
#: --lora-target: one or more module names (or q, k, v, o)
LORA_TARGETS = CommaList("module names", nonempty=True)
#: the options whose words are names in lower case, read whatever their case (``--task QA`` is qa)
CASELESS = ("task", "reg", "device")


def caseless(value):
    """A word of a :data:`CASELESS` option as the run reads it: stripped and in lower case."""
    return value.strip().lower() if isinstance(value, str) else value


#: the hidden states I-STAR penalises when --layers is unset (recorded as unset: null in run.json)
DEFAULT_LAYERS = "blocks"


@dataclass
class FinetuneConfig:
    """Options of one fine-tuning run, declared once (:mod:`geomscope.options`): ``geomscope
    finetune --help`` is built from these fields. ``model``, ``train``, ``eval`` and ``out`` are the
    run's inputs and output; ``monitor`` and ``extra`` are the library's alone.

    One run has one regulariser, lambda and seed: the CLI reads the comma lists of ``--reg``,
    ``--lambda`` and ``--seed`` (a grid, :mod:`geomscope.study.sweep`) and checks each item against
    the single-value field declared here (:func:`geomscope.options.check_value`).
    """

    model: str
    train: str
    out: str
    eval: str | None = None
    task: str = option(
        "classification",
        Choice(TASKS),
        "classification (single sentences or pairs, --text-field[-2], --label-field), qa: "
        "extractive question answering (SQuAD; span head, eval exact_match and f1 in percent) or "
        "causal-lm: next-token loss on text (a .txt file one document per line, or --text-field of "
        "a CSV/JSONL; --lm-batching), eval perplexity.",
        metavar="|".join(TASKS),
    )
    lm_batching: str = option(
        "pack",
        Choice(LM_BATCHING),
        "--task causal-lm rows: pack = the documents joined with EOS and cut into blocks of "
        "--max-length tokens; pad = one document per row (truncated to --max-length), padding left "
        "out of the loss and the penalties.",
        metavar=choice_metavar(LM_BATCHING),
    )
    reg: str = option(
        "istar",
        Choice(REGULARISERS),
        "Regulariser: I-STAR, CosReg or none; a comma list runs a grid.",
        metavar=choice_metavar(REGULARISERS) + "[,...]",
    )
    lam: float = option(
        -5.0,
        Interval(whole=False, words="a finite number"),
        "Weight of the penalty (I-STAR: < 0 pushes away from isotropy, > 0 toward it); a comma list "
        "(e.g. -1,-0.1,0,0.1,1) runs a grid.",
        metavar="FLOAT[,...]",
        flag="--lambda",
    )
    zeta: float = option(
        DEFAULT_ZETA, UNIT_INTERVAL, "IsoScore* shrinkage weight on C0 (0 = plain IsoScore).", metavar="FLOAT"
    )
    c0_points: int = option(
        250_000,
        Interval(whole=True, low=2),
        "Token vectors used for C0 each epoch (at most).",
        metavar="N",
    )
    layers: str | None = option(
        None,
        Layers(),
        "Hidden states for I-STAR: blocks | all | 1-6 | 2,4,-1 | layer_03 (default: "
        f"{DEFAULT_LAYERS}, every block; 0 = embedding output).",
        metavar="LIST",
        short="-l",
        optional=True,
    )
    epochs: int = option(4, POSITIVE_INT, "Training epochs.", metavar="N")
    lr: float = option(1e-5, _POSITIVE, "AdamW learning rate (peak rate with --scheduler).", metavar="FLOAT")
    batch_size: int = option(32, POSITIVE_INT, "Examples per step per process.", metavar="N")
    max_length: int = option(
        128, Interval(whole=True, low=2), "Truncate inputs to this many tokens.", metavar="N"
    )
    seed: int = option(
        0,
        FINETUNE_SEED,
        "Seed for the head, shuffling and dropout; a comma list runs a grid.",
        metavar="N[,...]",
    )
    precision: str = option(
        "fp32",
        Choice(PRECISIONS),
        "Training arithmetic, through Accelerate's mixed precision: fp32, fp16 (CUDA, gradient "
        "scaling) or bf16 (autocast).",
        metavar=choice_metavar(PRECISIONS),
    )
    device: str = option("auto", Device(), f"{DEVICE_HELP}.", metavar="DEVICE")
    include_padding: bool = option(
        False,
        Flag(),
        "Count padding positions in the training penalties and C0 (the official code's "
        "behaviour); default: excluded by the attention mask. The eval geometry (eval.jsonl, compare) "
        "never counts padding, so it does not depend on --batch-size.",
    )
    text_field: str = option("sentence", Text(), "Text field (column) of the examples.", metavar="NAME")
    text_field_2: str | None = option(
        None, Text(), "Second text column for sentence pairs (e.g. QNLI).", metavar="NAME", optional=True
    )
    label_field: str = option("label", Text(), "Column with the label.", metavar="NAME")
    resume: bool = option(False, Flag(), "Continue from the last epoch checkpoint in --out.")
    overwrite: bool = option(
        False, Flag(), "Replace a previous finetune output in --out (only the files it wrote)."
    )
    penalty_precision: str = option(
        "fp64",
        Choice(PENALTY_PRECISIONS),
        "I-STAR batch covariance arithmetic: fp64 (exact) or fp32 (centred rows, about half the cost; "
        "for GPUs with slow float64).",
        metavar=choice_metavar(PENALTY_PRECISIONS),
    )
    monitor: bool = True  # log batch IsoScore* (identity target) also for cosreg / none
    save_every: int | None = option(
        None,
        POSITIVE_INT,
        "Also keep the model every STEPS optimiser steps (and before the first) as "
        "DIR/checkpoints/step<N>/, for `extract --revisions 'DIR/checkpoints/*'`.",
        metavar="STEPS",
        optional=True,
    )
    log_geometry: int | None = option(
        None,
        POSITIVE_INT,
        "Every EVERY optimiser steps, log per chosen layer (--layers) and rank in steps.jsonl the "
        "share of the task-loss gradient's energy in the layer's own top-r activation subspace over "
        "the step's batch, against r/D, E_max and --geometry-controls random rank-r subspaces (mean, "
        "SD, p), as score --basis computes them on the same rows; and the batch IsoScore*. "
        "`geomscope plot DIR` draws it.",
        metavar="EVERY",
        optional=True,
    )
    geometry_rank: tuple[int, ...] = option(
        (8, 32),
        _RANKS,
        "Ranks r of the activation subspaces for --log-geometry (each below the hidden size D).",
        metavar="LIST",
    )
    geometry_controls: int = option(
        DEFAULT_CONTROLS,
        Interval(whole=True, low=0),
        "Random rank-r subspaces of U_r's complement per layer and rank for --log-geometry, seeded by "
        "--seed (score --basis --controls K --seed S draws the same).",
        metavar="K",
    )
    weight_decay: float | None = option(
        None,
        Interval(whole=False, low=0),
        "AdamW weight decay W on weights, none on biases and LayerNorm weights (as transformers "
        "does). Default: torch's AdamW default, 0.01 on every parameter (the released I-STAR setting).",
        metavar="W",
        optional=True,
    )
    scheduler: str = option(
        "constant",
        Choice(SCHEDULERS),
        "Learning-rate schedule over the run's optimiser steps (transformers' get_scheduler).",
        metavar=choice_metavar(SCHEDULERS),
    )
    warmup: float = option(
        0.0,
        UNIT_INTERVAL,
        "Linear warmup over this fraction of the optimiser steps (rounded up), then --scheduler.",
        metavar="RATIO",
    )
    grad_accum: int = option(
        1,
        POSITIVE_INT,
        "Micro-batches of --batch-size per optimiser step (gradients summed; the task loss is the "
        "mean over all N*batch examples). The I-STAR/CosReg penalty is taken per micro-batch (its own "
        "covariance) and averaged: one covariance over the accumulated batch would need every "
        "micro-batch's hidden states in memory at once.",
        metavar="N",
    )
    max_grad_norm: float | None = option(
        None,
        _POSITIVE,
        "Clip the global gradient norm (task loss + penalty, over all processes) to NORM before "
        "each update, through Accelerate; steps.jsonl logs grad_norm before clipping. Default: no "
        "clipping (the released I-STAR setting).",
        metavar="NORM",
        optional=True,
    )
    gradient_checkpointing: bool = option(
        False,
        Flag(),
        "Recompute each block's activations in the backward pass instead of storing them "
        "(transformers' gradient checkpointing): less memory for big models, about a third more "
        "compute, the same gradients.",
    )
    lora: int | None = option(
        None,
        POSITIVE_INT,
        "Train rank-R LoRA adapters (and the task head) instead of every weight; needs "
        "pip install 'geomscope[lora]'. Writes the merged model to --out and the adapter to --out/adapter/.",
        metavar="R",
        optional=True,
    )
    lora_alpha: float | None = option(
        None, _POSITIVE, "LoRA scaling alpha (default: 2*R).", metavar="A", optional=True
    )
    lora_target: str = option(
        "q,v",
        LORA_TARGETS,
        "Modules that get adapters: module names (query, value, q_proj, ...) or q, k, v, o.",
        metavar="LIST",
    )
    report_to: str = option(
        "none",
        Choice(TRACKERS),
        "Also log the step and eval records to TensorBoard (--out/tensorboard/), wandb (offline) or "
        "MLflow (file store --out/mlruns/); rank 0 only.",
        metavar=choice_metavar(TRACKERS),
    )
    extra: dict = field(default_factory=dict)  # recorded in run.json / summary.json (e.g. model alias)

    def layer_selection(self) -> str | list:
        """The ``--layers`` selection the run reads (:func:`geomscope.layers.parse_layers`):
        :data:`DEFAULT_LAYERS` when unset."""
        return DEFAULT_LAYERS if self.layers is None else self.layers

    def lora_targets(self) -> list[str]:
        """The module names of ``lora_target`` ("q,v" -> ["q", "v"])."""
        return LORA_TARGETS.items(self.lora_target)

    def validate(self) -> FinetuneConfig:
        """``self``, its ``geometry_rank`` read as a tuple of whole numbers ("8,32" -> (8, 32)), when
        every option meets its declaration (:func:`geomscope.options.check`) and the rules between
        options hold; InputError (one line) naming the option otherwise. The :data:`CASELESS`
        options are read in lower case first."""
        for name in CASELESS:
            setattr(self, name, caseless(getattr(self, name)))
        check(self)
        self.geometry_rank = geometry_ranks(self.geometry_rank)
        if self.eval is None:
            raise InputError("an evaluation file is needed: pass --eval FILE")
        if self.lm_batching != NEW_DEFAULTS["lm_batching"] and self.task != "causal-lm":
            raise InputError("--lm-batching sets the rows of --task causal-lm; pass --task causal-lm")
        if self.geometry_controls != NEW_DEFAULTS["geometry_controls"] and self.log_geometry is None:
            raise InputError(
                "--geometry-controls sets the controls of --log-geometry; pass --log-geometry EVERY"
            )
        if self.grad_accum > 1 and self.log_geometry is not None:
            raise InputError("--log-geometry does not support --grad-accum > 1 yet; pass one of them")
        self._check_lora()
        from geomscope.train.tracking import check_tracker

        check_tracker(self.report_to)  # the tracker's package is installed
        return self

    def _check_lora(self) -> None:
        if self.lora is None:
            if self.lora_alpha is not None or self.lora_target != NEW_DEFAULTS["lora_target"]:
                raise InputError("--lora-alpha and --lora-target need --lora RANK")
            return
        from geomscope.train.lora import check_peft

        if self.save_every is not None:
            raise InputError("--save-every does not support --lora yet (snapshots would hold only adapters)")
        check_peft()


def validate(cfg: FinetuneConfig) -> FinetuneConfig:
    """:meth:`FinetuneConfig.validate` as a function."""
    return cfg.validate()


def geometry_ranks(value) -> tuple[int, ...]:
    """``--geometry-rank`` as written ("8,32", a list of them) -> its whole numbers (8, 32), when it
    meets its declaration; OptionError (one line) otherwise."""
    check_value(FinetuneConfig, "geometry_rank", value)
    return tuple(_RANKS.items(value))


def check_seed(seed) -> None:
    """One line for a seed the generators cannot take (checked by a grid before any run, too)."""
    check_value(FinetuneConfig, "seed", seed)


#: the fingerprint's records of the data files' contents (a file changed in place keeps its path)
_DATA_KEYS = {"train_data": "train", "eval_data": "eval"}


def data_identity(path: str) -> dict:
    """sha256 and size of a data file's bytes (of a save_to_disk directory's files), as extract
    records its inputs (:func:`geomscope.fileio.input_digest`)."""
    from pathlib import Path

    p = Path(path)
    sha256, size = input_digest(p, str(path), directory=p.is_dir())
    return {"sha256": sha256, "bytes": size}


def fingerprint(cfg: FinetuneConfig, layers: list[int], world: int) -> dict:
    fp = {k: getattr(cfg, k) for k in _FINGERPRINT}
    for key, field_name in _DATA_KEYS.items():
        fp[key] = data_identity(getattr(cfg, field_name))
    if cfg.task == default_of(FinetuneConfig, "task"):
        del fp["task"]  # a fingerprint without task means the default one: those checkpoints resume
    fp["layers"] = layers
    fp["world_size"] = world
    fp.update(changed_options(cfg, fingerprint=True))
    if "scheduler" in fp or "warmup" in fp:  # a schedule spans the whole run: its length must match
        fp["epochs"] = cfg.epochs
    return fp


def check_same_run(out, stored: dict, asked: dict, epochs: int, advice: str | None = None) -> None:
    """Refuse, naming the first difference, to continue (or count as done) the run in ``out`` whose
    checkpoint holds the fingerprint ``stored`` with the options whose fingerprint is ``asked``.

    Options a stored fingerprint lacks compare at their defaults; keys only the stored fingerprint
    has are ignored; a fingerprint without the data files' contents is compared on their paths alone
    (it cannot say more)."""
    advice = advice or "resume with the same options or choose another --out"
    dflt = {"task": default_of(FinetuneConfig, "task"), **NEW_DEFAULTS}
    old = {**dflt, **stored}
    new = {**dflt, **asked}
    old.setdefault("epochs", epochs)  # no schedule before: the run's length was free
    new.setdefault("epochs", old["epochs"])
    for k in new:
        if k in _DATA_KEYS and k not in stored:
            continue
        if json_value(old.get(k)) == json_value(new[k]):
            continue
        if k in _DATA_KEYS:
            was, now = old[k] if isinstance(old[k], dict) else {}, new[k]  # (a damaged record: no sha)
            raise InputError(
                f"{out} was trained on other contents of {new[_DATA_KEYS[k]]} (sha256 "
                f"{str(was.get('sha256'))[:12]}, {was.get('bytes')} bytes; now {now['sha256'][:12]}, "
                f"{now['bytes']} bytes); {advice}"
            )
        raise InputError(f"{out} was trained with {k}={old.get(k)!r}, not {new[k]!r}; {advice}")


def changed_options(cfg: FinetuneConfig, fingerprint: bool = False) -> dict:
    """The options of :data:`NEW_DEFAULTS` that differ from their defaults (LoRA's alpha and targets
    only with --lora)."""
    out = {}
    for k, default in NEW_DEFAULTS.items():
        v = getattr(cfg, k)
        if v == default or (fingerprint and k in _NOT_FINGERPRINTED):
            continue
        out[k] = v
    if cfg.lora is not None:  # the resolved alpha is what trains
        out["lora_alpha"] = resolved_lora_alpha(cfg)
        out["lora_target"] = cfg.lora_target
    return out


def resolved_lora_alpha(cfg: FinetuneConfig) -> float:
    return float(cfg.lora_alpha) if cfg.lora_alpha is not None else 2.0 * cfg.lora


def config_record(cfg: FinetuneConfig) -> dict:
    """run.json's ``config``: every option, the newer ones only when not at their defaults."""
    rec = {k: v for k, v in asdict(cfg).items() if k not in NEW_DEFAULTS}
    rec.update(changed_options(cfg))
    return rec


def json_value(v):
    """Fingerprint values compare as JSON reads them back (tuples are lists)."""
    return list(v) if isinstance(v, tuple) else v
