"""The closed sets of option values, shared by the library's validation and the CLI's choices, and
the defaults that both an option and a library function take.

A light module (no torch, numpy or transformers) so that ``geomscope --help`` can show them.
"""

from __future__ import annotations

#: extract: the model's computation dtype, and the dtype of the stored shards
COMPUTE_DTYPES = ("float32", "float16", "bfloat16")
STORE_DTYPES = ("auto", "float16", "float32")  # auto: float16, or float32 when gradients are stored
#: extract: what is stored, and the loss whose gradients are (geomscope.extract.gradients)
CAPTURES = ("activations", "gradients", "activations,gradients")
LOSSES = ("auto", "causal-lm", "masked-lm", "classification")
#: extract --keep sample: how the accumulators' scatter is multiplied (geomscope.metrics.moments_torch)
ACCUMULATOR_PRODUCTS = ("float64", "split")
#: extract: which stack of an encoder-decoder model to read
STACKS = ("encoder", "decoder")
#: score: outlier rules (the functions live in geomscope.metrics.outliers.OUTLIER_RULES)
OUTLIER_RULES = ("variance", "zscore", "quantile", "magnitude")
OUTLIER_STATS = ("variance", "mean_abs")
#: score: the dtype of the covariance's block products (geomscope.metrics.moments)
PRODUCT_DTYPES = ("float64", "float32")
#: score: TwoNN fits (geomscope.metrics.twonn)
TWONN_FITS = ("linear", "mle")
#: score: the scikit-dimension estimators behind --id-estimator (name -> class in skdim.id;
#: geomscope.metrics.intrinsic wraps them), here so that validating names imports no scikit-learn
SKDIM_ESTIMATORS = {
    "mle": "MLE",
    "lpca": "lPCA",
    "danco": "DANCo",
    "mada": "MADA",
    "corrint": "CorrInt",
    "fishers": "FisherS",
    "mom": "MOM",
    "tle": "TLE",
    "mind_ml": "MiND_ML",
    "gride": "GRIDE",
}
#: score --seed: the row samples (and extract --keep's sample) hash the seed in 64 bits
#: (geomscope.store.sample.row_hash), so a larger seed would repeat a smaller one's samples
SEED_BITS = 64
MAX_SEED = 2**SEED_BITS - 1
MAX_SEED_TEXT = f"2^{SEED_BITS} - 1"  # how the errors write it
#: score and finetune: IsoScore*'s shrinkage weight zeta where none is given (the I-STAR release's)
DEFAULT_ZETA = 0.2
#: score --basis and finetune --log-geometry: random rank-r control subspaces per layer and rank
DEFAULT_CONTROLS = 20
#: score: the fraction of the largest TwoNN ratios left out of the fit (Facco et al.'s 10%)
DEFAULT_DISCARD_FRACTION = 0.1
#: finetune
REGULARISERS = ("istar", "cosreg", "none")
PRECISIONS = ("fp32", "fp16", "bf16")
PENALTY_PRECISIONS = ("fp64", "fp32")
TASKS = ("classification", "qa", "causal-lm")
LM_BATCHING = ("pack", "pad")  # finetune --task causal-lm: rows of packed blocks or one document each
SCHEDULERS = ("constant", "linear", "cosine")  # transformers' get_scheduler names
TRACKERS = ("none", "tensorboard", "wandb", "mlflow")
#: plot
FIGURE_FORMATS = ("png", "svg", "pdf")
DPI_RANGE = (10, 2400)  # the resolutions plot --dpi (plot_files) accepts, in dots per inch
PLOT_KINDS = (
    "auto",
    "layers",
    "spectrum",
    "outliers",
    "trajectory",
    "training",
    "energy",
    "similarity",
    "diagnostics",
)
#: export: the formats a run is written in (geomscope.export)
EXPORT_FORMATS = ("arrow", "npy")

#: --device-map: how accelerate spreads a model larger than one device
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
