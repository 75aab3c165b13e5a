"""Benchmark: `geomscope extract` as 1 process against 2 processes under torchrun (CPU, gloo).

The bundled all-MiniLM-L6-v2 over sample_data's sentences (repeated, shuffled), every hidden state,
float16 store, one torch thread per process, so that 2 processes use 2 cores. Each contender is a
fresh command (process start, model load and input scan included: what a user waits for); the
row reports real tokens per second of the whole command and, from the summary, of the shard loop
alone. On 2 cores, 2 processes can at best double the rate; what they share (the input scan and
model load, done by both) bounds them below that.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from _common import bench_args, median, print_rows  # noqa: E402
from bench_extract import make_corpus  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _extract(cmd_prefix: list[str], corpus: Path, out: Path, shard_docs: int) -> tuple[float, dict]:
    import subprocess

    from geomscope.model.names import bundled_minilm_dir

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    cmd = [*cmd_prefix, "extract", str(bundled_minilm_dir()), str(corpus), "--out", str(out)]
    cmd += ["--shard-docs", str(shard_docs), "-q", "--json"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-2000:])
    return seconds, json.loads(p.stdout.strip().splitlines()[-1])


def run(quick: bool = False, repeats: int | None = None) -> list[dict]:
    n_docs = 800 if quick else 4000
    repeats = repeats or (1 if quick else 3)
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    work = Path(tempfile.mkdtemp(prefix="bench_proc_"))
    try:
        corpus = make_corpus(n_docs, work / "corpus.txt")
        shard_docs = n_docs // 8
        one_cmd = [sys.executable, "-m", "geomscope"]
        wall = {"1": [], "2": []}
        loop = {"1": [], "2": []}
        rows = None
        for _ in range(repeats):  # alternated, each on a fresh run directory
            for name in ("1", "2"):
                out = work / f"run{name}"
                shutil.rmtree(out, ignore_errors=True)
                prefix = one_cmd
                if name == "2":
                    prefix = [
                        torchrun,
                        "--nproc-per-node",
                        "2",
                        "--master-port",
                        str(_port()),
                        "-m",
                        "geomscope",
                    ]
                s, summary = _extract(prefix, corpus, out, shard_docs)
                rows = summary["rows"]
                wall[name].append(rows / s)
                loop[name].append(summary["tokens_per_second"])
        w1, w2 = median(wall["1"]), median(wall["2"])
        ideal = min(2, os.cpu_count() or 1)  # the bound: 2 processes scale perfectly on the cores there are
        l1, l2 = median(loop["1"]), median(loop["2"])
        return [
            {
                "benchmark": f"extract MiniLM {rows:,} tokens: 2 processes (torchrun) vs 1, whole command",
                "geomscope": f"{w2:,.0f} tok/s",
                "alternative": f"{w1:,.0f} tok/s (1 process)",
                "ratio": w2 / w1,
                "target": "<= 2x on 2 cores",
                "of bound": w2 / w1 / ideal,
                "note": f"median of {repeats}; process start, model load and input scan included",
            },
            {
                "benchmark": "  the same, shard loop only (summary tokens_per_second)",
                "geomscope": f"{l2:,.0f} tok/s",
                "alternative": f"{l1:,.0f} tok/s (1 process)",
                "ratio": l2 / l1,
                "target": "<= 2x on 2 cores",
                "of bound": l2 / l1 / ideal,
                "note": "all processes' rows over the slowest process's loop time",
            },
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    print_rows(run(quick=bench_args(__doc__).quick), "extract processes")
