"""``ExtractOptions``: everything ``extract`` needs besides the model, the inputs and the run directory."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from geomscope.choices import ACCUMULATOR_PRODUCTS, COMPUTE_DTYPES, DEVICE_MAPS, LOSSES, STACKS, STORE_DTYPES
from geomscope.devices import DEVICE_HELP
from geomscope.errors import InputError
from geomscope.options import (
    POSITIVE_INT,
    PROBABILITY,
    SEED,
    SEED_RANGE,
    Choice,
    Device,
    Flag,
    Layers,
    Parsed,
    Text,
    check,
    choice_metavar,
    option,
)


def _keep(spec: str):
    from geomscope.extract.keep import parse_keep

    return parse_keep(spec)


def _capture(spec: str):
    from geomscope.extract.gradients import parse_capture

    return parse_capture(spec)


def _modules(spec: str):
    from geomscope.model.modules import parse_modules

    return parse_modules(spec)


def max_memory_map(spec: str | None) -> dict | None:
    """``--max-memory 0=20GiB,cpu=64GiB`` -> {0: "20GiB", "cpu": "64GiB"} (accelerate's form)."""
    if not spec:
        return None
    out: dict = {}
    for item in str(spec).split(","):
        dev, sep, size = item.strip().partition("=")
        if not sep or not dev.strip() or not size.strip():
            raise InputError(
                f"--max-memory {spec!r}: write DEVICE=SIZE pairs, e.g. 0=20GiB,1=20GiB,cpu=64GiB"
            )
        dev = dev.strip()
        out[int(dev) if dev.isdigit() else dev] = size.strip()
    return out


@dataclass(frozen=True)
class ExtractOptions:
    """Everything ``extract`` needs besides the model, the inputs and the run directory, declared
    once (:mod:`geomscope.options`): ``geomscope extract --help`` is built from these fields.

    ``layers`` is read by :mod:`geomscope.layers` against the model's hidden states. ``text_field``
    names the text of .jsonl records and datasets, and of .csv/.tsv files unless ``text_column``
    names another column (None: ``text_field``, resolved by :meth:`validate`).
    """

    layers: str | list | tuple = option(
        "all",
        Layers(),
        "all | blocks | 0,6,12 | 4-8 | -1 | layer_06 | final_norm: hidden states to keep (0 = embeddings, "
        "i = block i, -1 = the last block, final_norm = the final norm's output).",
        metavar="LIST",
        short="-l",
    )
    modules: str | None = option(
        None,
        Parsed(_modules, bad=("", "*.mlp,", "*.mlp:sideways", "q:in")),
        "Also store these modules' outputs as layers: paths in model.named_modules() with globs "
        "(*.mlp, gpt_neox.layers.*.attention), PATTERN:in for a module's input, or aliases attn_out, "
        "mlp_out, ln1_in, ln1_out, ln2_in, ln2_out, q, k, v, norms (every norm, in and out).",
        metavar="PATTERN[,...]",
        optional=True,
    )
    revision: str | None = option(
        None, Text(), "Hub revision: tag, branch or commit.", metavar="REV", optional=True
    )
    dtype: str = option(
        "float32", Choice(COMPUTE_DTYPES), "Model computation dtype.", metavar=choice_metavar(COMPUTE_DTYPES)
    )
    store_dtype: str = option(
        "auto",
        Choice(STORE_DTYPES),
        "Shard dtype (auto: float16, or float32 when gradients are stored).",
        metavar=choice_metavar(STORE_DTYPES),
    )
    device: str = option("auto", Device(), f"{DEVICE_HELP}.", metavar="DEVICE")
    device_map: str | None = option(
        None,
        Choice(DEVICE_MAPS),
        "A model larger than one device: spread its layers over the GPUs (and CPU) with "
        "accelerate's big-model loading; one process per model replica.",
        metavar="|".join(DEVICE_MAPS),
        optional=True,
    )
    max_memory: str | None = option(
        None,
        Parsed(max_memory_map, bad=("0:20GiB", "=", "cpu=")),
        "Limits of --device-map, e.g. 0=20GiB,1=20GiB,cpu=64GiB.",
        metavar="DEV=SIZE,...",
        optional=True,
    )
    trust_remote_code: bool = option(False, Flag(), "Allow the model's own code.")
    stack: str | None = option(
        None,
        Choice(("auto", *STACKS)),
        "Encoder-decoder models: the encoder (default) or the decoder (teacher-forced on the document).",
        metavar=choice_metavar(STACKS),
        optional=True,
    )
    text_field: str = option(
        "text",
        Text(),
        "Text field of .jsonl records and datasets, or column of .csv/.tsv files.",
        metavar="NAME",
    )
    text_column: str | None = option(
        None,
        Text(),
        "Deprecated spelling of --text-field for .csv/.tsv files.",
        metavar="NAME",
        optional=True,
        hidden=True,
    )
    max_docs: int | None = option(
        None, POSITIVE_INT, "Use only the first N non-empty documents.", metavar="N", optional=True
    )
    max_tokens: int | None = option(
        None,
        POSITIVE_INT,
        "Stop after N rows (tokens); the last document is cut.",
        metavar="N",
        optional=True,
    )
    max_length: int | None = option(
        None,
        POSITIVE_INT,
        "Truncate documents to N tokens (default: the model's limit).",
        metavar="N",
        optional=True,
    )
    batch_tokens: int = option(
        8192,
        POSITIVE_INT,
        "Padded tokens per batch (memory knob; does not change the stored rows).",
        metavar="N",
    )
    shard_docs: int = option(1000, POSITIVE_INT, "Documents per shard (the unit of resume).", metavar="N")
    keep: str = option(
        "all",
        Parsed(_keep, bad=("some", "sample:0", "sample:x")),
        "all: store every row. sample:N (sample = sample:5000): store per shard each layer's "
        "float64 accumulators, measured on the model's device during the forward pass, and the "
        "seeded sample of N rows that score --id-sample draws; for corpora too large to store.",
        metavar="all|sample[:N]",
    )
    products: str = option(
        "float64",
        Choice(ACCUMULATOR_PRODUCTS),
        "--keep sample: how the accumulators' covariance is multiplied: float64, or split: exact "
        "float16 parts on the GPU's tensor cores, float32 sums over 2,048 rows, float64 between "
        "them (about 1e-7 relative; float16 rows).",
        metavar=choice_metavar(ACCUMULATOR_PRODUCTS),
    )
    seed: int = option(
        0,
        SEED,
        "Seed of the --keep sample (score --seed N draws the same rows) and of the masked-lm masks: "
        f"{SEED_RANGE}.",
        metavar="N",
    )
    capture: str = option(
        "activations",
        Parsed(_capture, bad=("", "weights", "activations,weights")),
        "What to store per token: the hidden states, and/or the gradient of the loss with "
        "respect to them (stored as <layer>.grad, one forward and backward pass).",
        metavar="activations|gradients|activations,gradients",
    )
    loss: str = option(
        "auto",
        Choice(LOSSES),
        "The loss of --capture gradients: causal-lm (next token), masked-lm, classification "
        "(--label-field); auto = the checkpoint's own head. Each document's loss is its mean.",
        metavar=choice_metavar(LOSSES),
    )
    mlm_probability: float = option(
        0.15,
        PROBABILITY,
        "masked-lm: chance that a token is masked (seeded by --seed and the document id).",
        metavar="P",
    )
    label_field: str = option("label", Text(), "classification: the label field or column.", metavar="NAME")
    overwrite: bool = option(False, Flag(), "Delete an existing run in --out and start over.")
    cache_dir: str | None = option(
        None, Text(), "Hugging Face cache directory.", metavar="DIR", optional=True
    )
    allow_nonfinite: bool = option(
        False, Flag(), "Exit 0 even if activations hold NaN/Inf (they are flagged either way)."
    )

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def gradients(self) -> bool:
        """Whether gradients are captured (``--capture gradients`` or ``activations,gradients``)."""
        from geomscope.extract.gradients import parse_capture

        return parse_capture(self.capture)[1]

    @property
    def max_memory_map(self) -> dict | None:
        """``--max-memory`` as accelerate takes it (:func:`max_memory_map`)."""
        return max_memory_map(self.max_memory)

    def validate(self) -> ExtractOptions:
        """A checked copy with ``store_dtype`` (``auto``) and ``text_column`` (None) resolved;
        OptionError (one line) naming the option otherwise: each option against its declaration,
        then the rules between options."""
        check(self)
        if self.device_map is not None and self.device not in ("auto", None):
            raise InputError("--device-map places the model itself; drop --device")
        self._check_gradients()
        out = self if self.text_column is not None else replace(self, text_column=self.text_field)
        if self.store_dtype == "auto":
            out = replace(out, store_dtype="float32" if self.gradients else "float16")
        out._check_products()
        return out

    def _check_products(self) -> None:
        if self.products == "float64":
            return
        if self.sample_size is None:
            raise InputError(
                f"--products {self.products} multiplies the accumulators of --keep sample; add --keep "
                "sample, or drop --products"
            )
        if self.store_dtype != "float16":
            raise InputError(
                f"--products {self.products} splits float16 rows; use --store-dtype float16 (the "
                "default), or --products float64"
            )

    def _check_gradients(self) -> None:
        if self.gradients and self.store_dtype == "float16":
            raise InputError(
                "--store-dtype float16 cannot hold gradients (they are mostly below float16's normal "
                "range, 6e-5); use --store-dtype float32 (the default for gradients)"
            )
        if self.gradients and self.sample_size is not None:
            raise InputError("--keep sample stores activations only; use --keep all with --capture gradients")

    @property
    def sample_size(self) -> int | None:
        """Rows of the seeded sample each shard keeps (``--keep sample:N``), or None (every row)."""
        from geomscope.extract.keep import parse_keep

        return parse_keep(self.keep)
