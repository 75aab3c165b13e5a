"""``ExtractOptions``: everything ``extract`` needs besides the model, the inputs and the run directory."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from geomscope.choices import COMPUTE_DTYPES, LOSSES, STACKS, STORE_DTYPES
from geomscope.errors import InputError


@dataclass(frozen=True)
class ExtractOptions:
    """See ``geomscope extract --help``; the field names are the CLI's options (``--max-docs`` ...).

    ``layers``: ``all`` | ``blocks`` | ``0,6,12`` | ``4-8`` | ``-1`` | ``layer_06`` | ``final_norm``
    (indices into ``output_hidden_states``; the grammar is :mod:`geomscope.layers`). ``text_field``
    names the text of .jsonl records and datasets, ``text_column`` that of .csv/.tsv files (the
    CLI's ``--text-field`` sets both).
    """

    layers: str | list | tuple = "all"
    revision: str | None = None
    dtype: str = "float32"
    store_dtype: str = "auto"  # float16; float32 when gradients are stored (they underflow float16)
    device: str = "auto"
    trust_remote_code: bool = False
    stack: str | None = None
    text_field: str = "text"
    text_column: str = "text"
    max_docs: int | None = None
    max_tokens: int | None = None
    max_length: int | None = None
    batch_tokens: int = 8192
    shard_docs: int = 1000
    overwrite: bool = False
    cache_dir: str | None = None
    allow_nonfinite: bool = False
    keep: str = "all"  # "all" | "sample" | "sample:N" (keep.py)
    seed: int = 0  # the --keep sample's seed (score --seed draws the same rows from a full run); masking's
    device_map: str | None = (
        None  # auto | balanced | balanced_low_0 | sequential: a model larger than a device
    )
    max_memory: str | None = None  # "0=20GiB,1=20GiB,cpu=64GiB": per-device limits of --device-map
    capture: str = "activations"  # "activations" | "gradients" | "activations,gradients" (gradients.py)
    loss: str = "auto"  # the loss whose gradients are stored: auto (the checkpoint's head) or LOSSES
    mlm_probability: float = 0.15
    label_field: str = "label"

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def gradients(self) -> bool:
        """Whether gradients are captured (``--capture gradients`` or ``activations,gradients``)."""
        from geomscope.extract.gradients import parse_capture

        return parse_capture(self.capture)[1]

    @property
    def max_memory_map(self) -> dict | None:
        """``--max-memory 0=20GiB,cpu=64GiB`` -> {0: "20GiB", "cpu": "64GiB"} (accelerate's form)."""
        if not self.max_memory:
            return None
        out: dict = {}
        for item in str(self.max_memory).split(","):
            dev, sep, size = item.strip().partition("=")
            if not sep or not dev.strip() or not size.strip():
                raise InputError(
                    f"--max-memory {self.max_memory!r}: write DEVICE=SIZE pairs, "
                    "e.g. 0=20GiB,1=20GiB,cpu=64GiB"
                )
            dev = dev.strip()
            out[int(dev) if dev.isdigit() else dev] = size.strip()
        return out

    def validate(self) -> ExtractOptions:
        """A checked copy with ``store_dtype`` resolved (``auto``); InputError (one line) naming the
        option otherwise."""
        for option, value in (
            ("--max-docs", self.max_docs),
            ("--max-tokens", self.max_tokens),
            ("--max-length", self.max_length),
        ):
            if value is not None:
                _positive(option, value)
        _positive("--batch-tokens", self.batch_tokens)
        self.sample_size  # noqa: B018 -- parses --keep (InputError when malformed)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise InputError(f"--seed must be a non-negative whole number, not {self.seed!r}")
        _positive("--shard-docs", self.shard_docs)
        _one_of("--dtype", self.dtype, COMPUTE_DTYPES)
        _one_of("--store-dtype", self.store_dtype, STORE_DTYPES)
        self.max_memory_map  # noqa: B018 -- parses --max-memory
        if self.device_map is not None and self.device not in ("auto", None):
            raise InputError("--device-map places the model itself; drop --device")
        if self.stack not in (None, "auto"):
            _one_of("--stack", self.stack, STACKS)
        self._check_gradients()
        if self.store_dtype != "auto":
            return self
        return replace(self, store_dtype="float32" if self.gradients else "float16")

    def _check_gradients(self) -> None:
        _one_of("--loss", self.loss, LOSSES)
        grads = self.gradients  # parses --capture
        if not (isinstance(self.mlm_probability, (int, float)) and 0 < self.mlm_probability < 1):
            raise InputError(f"--mlm-probability must be between 0 and 1, not {self.mlm_probability!r}")
        if grads and self.store_dtype == "float16":
            raise InputError(
                "--store-dtype float16 cannot hold gradients (they are mostly below float16's normal "
                "range, 6e-5); use --store-dtype float32 (the default for gradients)"
            )
        if grads and self.sample_size is not None:
            raise InputError("--keep sample stores activations only; use --keep all with --capture gradients")

    @property
    def sample_size(self) -> int | None:
        """Rows of the seeded sample each shard keeps (``--keep sample:N``), or None (every row)."""
        from geomscope.extract.keep import parse_keep

        return parse_keep(self.keep)


def _positive(option: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InputError(f"{option} must be a positive whole number, not {value!r}")


def _one_of(option: str, value, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise InputError(f"{option} {value} is not one of {', '.join(allowed)}")
