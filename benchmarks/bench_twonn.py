"""TwoNN intrinsic dimension: geomscope vs scikit-dimension 0.5.0, fastwonn 0.0.9 and torch.cdist + topk.

    python benchmarks/bench_twonn.py [--quick] [--sizes 20000,50000] [--repeats 3]
                                     [--only geomscope,brute,skdim,fastwonn,cdist,minilm,clusters]

Data: float32 (N, 768) points = a random 20-d Gaussian subspace + isotropic noise (sigma 0.1), no
duplicates, seed 0. Contenders, each computing the linear TwoNN (discard 0.1, F_i = i/N):

- geomscope: ``geomscope.metrics.twonn(X)`` -- duplicate check, exact two-NN search, fit; torch
  with its default threads. The default (``prune=None``) estimates on 128 sampled rows whether
  exact candidate pruning on the top principal directions pays and uses it if so (it does on this
  data: 99% of the variance in 20 directions); "brute" rows force ``prune=False`` (symmetric
  float32 GEMM strips + certified float64 refinement). Both are exact.
- skdim: ``skdim.id.TwoNN().fit(X)`` (sklearn ``pairwise_distances_chunked`` + a full sort of
  every distance row). Skipped at N = 50,000, where it would take many minutes (O(N^2 log N));
  the note gives an extrapolation from the 20,000 timing instead.
- fastwonn: ``fastwonn.twonn_id(torch.from_numpy(X))`` (its default torch path: the full N x N
  ``torch.cdist`` in float32, ``topk(3)``, rows with r1 = 0 or r1 = r2 dropped, the same linear
  fit on mu^2 doubled). It imports ``torchsort`` for its differentiable path only; where
  torchsort is not installed (it needs a C++/CUDA build) a stand-in module is put in
  ``sys.modules`` first, which the non-differentiable path never calls. Skipped above 20,000 rows
  (its N x N float32 matrix) or when fastwonn is not installed.
- cdist+topk: the fastest plain alternative from installed libraries: row blocks of
  ``torch.cdist(X[block], X)`` (float32, matrix-product mode), self masked, ``topk(2)``, same fit;
  its blocks use the same 256 MiB budget. Not exact for near-duplicates (no refinement).

Clusters row: 16,000 x 768 float32 rows in two tight clusters (sigma 1e-3) far from the mean, where
the float32 search cannot rank any cluster's members and every row goes to the certified float64
rescreen; against blocked ``torch.cdist`` + ``topk`` in float64 (right here, though nothing
certifies it), with the float32 one's answer in the note (it cannot tell the members apart).

MiniLM rows (full run): the bundled all-MiniLM-L6-v2's own activations on sample_data/sentences.txt
(the first 8,000 tokens of its 400 sentences; layers 1, 3 and 6), pruning forced (``prune=True``,
one run) against brute force: how many pairs pruning leaves to compute exactly, the speed-up, and
which one the automatic choice takes there (real activations have far flatter spectra than the
synthetic data).

Timings alternate the contenders on the same array (``_common.alternate``), 1 warm-up (none at
N >= 20,000), medians of ``repeats``; ratio = alternative seconds / geomscope seconds (> 1:
geomscope is faster). Each note ends with the 1-minute load average when the row finished: on a
shared machine the multi-threaded ops stall while other processes hold the cores.

The bound ("of bound") is the brute-force one: the float32 GEMM of half the distance matrix
(N^2 D flops) at the machine's measured rate. Brute force can at best reach it; the pruned search
does less arithmetic and can exceed 1.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from _common import alternate, machine_limits, of_bound, print_rows  # noqa: E402

D = 768
BUDGET = 256 * 2**20


def make_data(n: int, d: int = D, intrinsic: int = 20, noise: float = 0.1, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, intrinsic), dtype=np.float32)
    basis = rng.standard_normal((intrinsic, d), dtype=np.float32) / np.float32(math.sqrt(intrinsic))
    x = z @ basis
    x += np.float32(noise) * rng.standard_normal((n, d), dtype=np.float32)
    return x


def geomscope_twonn(x) -> float:
    from geomscope.metrics.twonn import twonn

    return twonn(x).dimension


def skdim_twonn(x) -> float:
    import skdim

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(skdim.id.TwoNN().fit(x).dimension_)


def geomscope_brute_twonn(x) -> float:
    from geomscope.metrics.twonn import twonn

    return twonn(x, prune=False).dimension


TORCHSORT_STANDIN = False


def fastwonn_available() -> bool:
    """Import fastwonn, with a stand-in ``torchsort`` module where torchsort is not installed."""
    import importlib.util
    import types

    if importlib.util.find_spec("fastwonn") is None:
        return False
    if importlib.util.find_spec("torchsort") is None and "torchsort" not in sys.modules:
        stub = types.ModuleType("torchsort")

        def soft_sort(*args, **kwargs):  # only fastwonn's differentiable=True path calls it
            raise RuntimeError("torchsort stand-in: the differentiable path is not benchmarked")

        stub.soft_sort = stub.soft_rank = soft_sort
        sys.modules["torchsort"] = stub
        global TORCHSORT_STANDIN
        TORCHSORT_STANDIN = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "PyKeOps / FAISS not found, falling back to torch"
        import fastwonn  # noqa: F401
    return True


def fastwonn_twonn(x) -> float:
    import fastwonn
    import torch

    return float(fastwonn.twonn_id(torch.from_numpy(x)))


def cdist_topk_twonn(x, dtype=None) -> float:
    """Blocked ``torch.cdist`` + ``topk(2)`` in ``x``'s dtype (or ``dtype``), then the same fit."""
    import torch

    from geomscope.metrics.twonn import fit_mu

    xt = torch.from_numpy(x if dtype is None else x.astype(dtype))
    n = xt.shape[0]
    block = max(64, min(n, BUDGET // (xt.element_size() * n)))
    r1 = torch.empty(n, dtype=xt.dtype)
    r2 = torch.empty(n, dtype=xt.dtype)
    for s in range(0, n, block):
        e = min(s + block, n)
        dist = torch.cdist(xt[s:e], xt)
        dist[torch.arange(e - s), torch.arange(s, e)] = math.inf
        v = dist.topk(2, dim=1, largest=False).values
        r1[s:e], r2[s:e] = v[:, 0], v[:, 1]
    return fit_mu((r2 / r1).double().numpy())[0]


def _row(name, t, ours, alt, repeats, frac, target, note):
    return {
        "benchmark": name,
        "geomscope": t,
        "alternative": alt,
        "ratio": alt / t if alt else None,
        "target": target,
        "of bound": frac,
        "note": note,
    }


CLUSTER_ROWS = 16000


def two_clusters(n: int = CLUSTER_ROWS, d: int = D, seed: int = 0) -> np.ndarray:
    """Two tight clusters (sigma 1e-3) at +-c, |c| ~ 30 sqrt(D), float32: the float32 search cannot
    rank a cluster's members, so every row goes to the float64 rescreen (real [CLS] / first-token
    rows are such a cluster, a few hundred rows rather than all)."""
    rng = np.random.default_rng(seed)
    c = 30.0 * rng.normal(size=d)
    half = n // 2
    x = np.concatenate([c + 1e-3 * rng.normal(size=(half, d)), -c + 1e-3 * rng.normal(size=(n - half, d))])
    return x.astype(np.float32)


def cluster_rows(repeats: int, quick: bool) -> list[dict]:
    """geomscope's exact TwoNN where every row needs the float64 rescreen, against float64 blocked
    cdist + topk (right here, and not certified) and the float32 one (wrong here)."""
    from geomscope.metrics.twonn import twonn

    n = 4000 if quick else CLUSTER_ROWS
    x = two_clusters(n)
    res = twonn(x, prune=False)
    info = res.neighbor_info
    from geomscope.errors import DataError

    f64 = cdist_topk_twonn(x, np.float64)
    try:
        f32 = f"{cdist_topk_twonn(x):.4f}"
    except DataError:  # every r2 / r1 rounds to 1: float32 cannot tell the members apart
        f32 = "undefined (every r2/r1 = 1)"
    t = alternate(
        {"geomscope": lambda: twonn(x, prune=False), "cdist64": lambda: cdist_topk_twonn(x, np.float64)},
        repeats=repeats,
        warmup=0,
    )
    bound = n * n * D / (machine_limits(quick)["gemm_f32_gflops"] * 1e9)
    return [
        _row(
            f"TwoNN N={n:,} x {D}, two tight clusters far from the mean, vs float64 cdist+topk blocks",
            t["geomscope"],
            res.dimension,
            t["cdist64"],
            repeats,
            of_bound(bound, t["geomscope"]),
            "-",
            f"seconds (median of {repeats}); {info['n_flagged']:,} rows rescreened in float64, "
            f"{info['n_rescreen_pairs']:,} pairs exact; d = {res.dimension:.4f} vs float64 {f64:.4f}, "
            f"float32 cdist {f32}; load {os.getloadavg()[0]:.1f}",
        )
    ]


MINILM_LAYERS = (1, 3, 6)
MINILM_ROWS = 8000  # the first 8,000 tokens: forced pruning takes 50-110 s per layer on all 15,492


def minilm_layers(layers=MINILM_LAYERS) -> dict[int, np.ndarray]:
    """Token rows (float32) of the bundled MiniLM's ``layers`` over sample_data/sentences.txt."""
    import shutil
    import tempfile

    from geomscope.extract.run import extract
    from geomscope.store import Run, iter_shard

    text = Path(__file__).resolve().parents[1] / "sample_data" / "sentences.txt"
    work = Path(tempfile.mkdtemp(prefix="bench-twonn-minilm-"))
    try:
        extract("bundled:minilm", [text], work / "run", layers=",".join(map(str, layers)), device="cpu")
        run = Run(work / "run")
        out = {}
        for i, name in zip(layers, [la["name"] for la in run.layers], strict=True):
            chunks = [c.layers[name] for s in run.shards for c in iter_shard(run.shard_path(s), [name])]
            out[i] = np.concatenate(chunks).astype(np.float32)
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def minilm_rows(repeats: int) -> list[dict]:
    """Pruning forced vs brute force on the bundled MiniLM's layers (both exact: the same neighbours)."""
    import time

    from geomscope.metrics.twonn import twonn

    rows = []
    for layer, x in minilm_layers().items():
        x = x[:MINILM_ROWS]
        t0 = time.perf_counter()
        pruned = twonn(x, prune=True)  # timed once: 20-80x slower than brute force here
        t = {"pruned": time.perf_counter() - t0}
        brute, auto = twonn(x, prune=False), twonn(x)
        info = pruned.neighbor_info
        choice = "pruned" if auto.neighbor_info.get("pruned") else "brute force"
        t["brute"] = alternate({"brute": lambda x=x: twonn(x, prune=False)}, repeats=repeats)["brute"]
        rows.append(
            _row(
                f"TwoNN, bundled MiniLM layer {layer} ({x.shape[0]:,} x {x.shape[1]} tokens): pruning "
                "forced vs brute force",
                t["pruned"],
                pruned.dimension,
                t["brute"],
                repeats,
                None,
                "brute force kept where pruning does not pay",
                f"seconds (pruned: one run; brute: median of {repeats}); pruned: k={info.get('prune_width')} "
                "directions, "
                f"{info.get('pair_fraction', float('nan')):.1e} of pairs exact; automatic choice: {choice}; "
                f"d = {pruned.dimension:.4f} (brute {brute.dimension:.4f}); load {os.getloadavg()[0]:.1f}",
            )
        )
    return rows


CONTENDERS = ("geomscope", "brute", "skdim", "fastwonn", "cdist", "minilm", "clusters")


def run(
    quick: bool = False, sizes: list[int] | None = None, repeats: int | None = None, only=None
) -> list[dict]:
    """Rows for each size; ``only``: the contenders to run (geomscope always runs)."""
    sizes = sizes or ([3000, 6000] if quick else [5000, 10000, 20000, 50000])
    repeats = repeats or (2 if quick else 3)
    synthetic = not only or bool(set(only) - {"minilm", "clusters"})  # `--only minilm`: those rows alone
    only = set(only or CONTENDERS) | {"geomscope"}
    skdim_max = fastwonn_max = 20000
    has_fastwonn = fastwonn_available()
    rows = []
    skdim_20k = None
    for n in sizes if synthetic else []:
        x = make_data(n)
        fns = {
            "geomscope": lambda x=x: geomscope_twonn(x),
            "brute": lambda x=x: geomscope_brute_twonn(x),
            "cdist": lambda x=x: cdist_topk_twonn(x),
        }
        if n <= skdim_max:
            fns["skdim"] = lambda x=x: skdim_twonn(x)
        if has_fastwonn and n <= fastwonn_max:
            fns["fastwonn"] = lambda x=x: fastwonn_twonn(x)
        fns = {k: f for k, f in fns.items() if k in only}
        # values once (outside timing), then timings alternating
        from geomscope.metrics.twonn import twonn

        res = twonn(x)
        ours, info = res.dimension, res.neighbor_info
        vals = {k: fns[k]() for k in fns if k != "geomscope"}
        t = alternate(fns, repeats=repeats, warmup=0 if n >= 20000 else 1)
        tag = f"TwoNN N={n:,} x {D} float32"
        load = f"; load {os.getloadavg()[0]:.1f}"
        # the bound: the float32 GEMM of half the distance matrix, N^2 D flops (of 2 N^2 D for all pairs)
        bound = n * n * D / (machine_limits(quick)["gemm_f32_gflops"] * 1e9)
        frac = of_bound(bound, t["geomscope"])
        frac_brute = of_bound(bound, t["brute"]) if "brute" in t else None
        how = (
            f"pruned: k={info['prune_width']} directions, {info['pair_fraction']:.1e} of pairs exact"
            if info.get("pruned")
            else "brute force (pruning estimated not to pay)"
        )
        med = f"seconds (median of {repeats}); geomscope {how}"
        if "skdim" in fns:
            if n == 20000:
                skdim_20k = t["skdim"]
            sk = vals["skdim"]
            rows.append(
                _row(
                    f"{tag} vs skdim 0.5.0",
                    t["geomscope"],
                    ours,
                    t["skdim"],
                    repeats,
                    frac,
                    ">= 8x at 20,000" if n == 20000 else "-",
                    f"{med}; d = {ours:.4f} vs {sk:.4f} (rel. diff {abs(ours / sk - 1):.1e}){load}",
                )
            )
            if "brute" in t:
                rows.append(
                    _row(
                        f"{tag} brute force (prune=False) vs skdim 0.5.0",
                        t["brute"],
                        ours,
                        t["skdim"],
                        repeats,
                        frac_brute,
                        "-",
                        f"seconds (median of {repeats}){load}",
                    )
                )
        elif "brute" in t:
            extra = ""
            if skdim_20k is not None:
                est = skdim_20k * (n / 20000) ** 2 * math.log(n) / math.log(20000)
                extra = f"; skdim skipped (~{est / 60:.0f} min extrapolated as N^2 log N from 20,000)"
            rows.append(
                _row(
                    f"{tag} vs brute force (prune=False)",
                    t["geomscope"],
                    ours,
                    t["brute"],
                    repeats,
                    frac,
                    "-",
                    f"{med}; brute of bound {frac_brute:.2f}; d = {ours:.4f}{extra}{load}",
                )
            )
        if "fastwonn" in fns:
            fw = vals["fastwonn"]
            rows.append(
                _row(
                    f"{tag} vs fastwonn 0.0.9",
                    t["geomscope"],
                    ours,
                    t["fastwonn"],
                    repeats,
                    frac,
                    ">= 1.5x at 20,000" if n == 20000 else "-",
                    f"{med}; d = {ours:.4f} vs {fw:.4f} (float32, mu^2 fit; rel. diff "
                    f"{abs(ours / fw - 1):.1e}); torchsort stand-in: "
                    f"{'yes' if TORCHSORT_STANDIN else 'no'}{load}",
                )
            )
        elif n <= fastwonn_max and "fastwonn" in only:
            rows.append(
                _row(
                    f"{tag} vs fastwonn 0.0.9",
                    t["geomscope"],
                    ours,
                    None,
                    repeats,
                    frac,
                    "-",
                    f"fastwonn not installed: skipped{load}",
                )
            )
        if "cdist" in t:
            rows.append(
                _row(
                    f"{tag} vs cdist+topk blocks",
                    t["geomscope"],
                    ours,
                    t["cdist"],
                    repeats,
                    frac,
                    "> 1",
                    f"{med}; d = {ours:.4f} vs {vals['cdist']:.4f} (float32 distances){load}",
                )
            )
    if "clusters" in only:
        rows.extend(cluster_rows(repeats, quick))
    if not quick and "minilm" in only:
        rows.extend(minilm_rows(repeats))
    return rows


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="sizes 3,000 and 6,000, 2 repeats (a smoke run)")
    ap.add_argument("--sizes", default="", help="comma list of N, e.g. 20000 (default 5k,10k,20k,50k)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per contender (default 3)")
    ap.add_argument("--only", default="", help="comma list of contenders: " + ",".join(CONTENDERS))
    args = ap.parse_args(argv)
    sizes = [int(v) for v in args.sizes.split(",") if v.strip()] or None
    only = [v.strip() for v in args.only.split(",") if v.strip()] or None
    bad = set(only or ()) - set(CONTENDERS)
    if bad:
        ap.error(f"unknown contender(s) {', '.join(sorted(bad))}; use {', '.join(CONTENDERS)}")
    print_rows(run(args.quick, sizes, args.repeats, only), "TwoNN intrinsic dimension")


if __name__ == "__main__":
    main()
