"""Do two commits write the same outputs? ``python .ci/same_outputs.py BASE [HEAD]``

A refactoring is meant to change no output. This script checks it on what a user runs: each
commit is checked out in a temporary worktree and runs, with this checkout's ``.venv``, the same
commands over the same inputs (the Makefile's demo, gradients and trajectory targets, plus an
HTML page, a ``--keep sample`` run, a small fine-tuning, every diagnostic (``--metrics all``) and
its figure, a ``--modules`` run, and a causal-LM fine-tuning of a tiny random GPT-NeoX), in the
same folder; the two output
trees are then compared file by file:

- JSON and JSONL: equal once the keys that record when or how fast (``created``, ``finished``,
  ``last_invocation``, seconds, rates) are dropped; CSV and text: equal; an HTML page: equal
  once its time stamps and the ids matplotlib draws at random inside its SVG figures are masked;
- HDF5 shards: the same datasets (names, dtypes, shapes, values) and attributes;
- PNG, SVG, HTML and the rest: the same bytes.

It prints one line per differing file and exits 1 if any differs. Both commits must be committed;
with ``--keep DIR`` the outputs stay there for a look.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv"
#: keys whose values say when, where or how fast a run went, not what it computed
VOLATILE_KEYS = {
    "created",
    "finished",
    "last_invocation",
    "started",
    "elapsed",
    "elapsed_s",
    "seconds",
    "duration_s",
    "tokens_per_second",
    "rows_per_second",
    "wall_s",
    "timestamp",
    "time",
}
#: an ISO 8601 time, as a page prints when its report was made
TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?([+-]\d\d:\d\d|Z)?")
#: a figure embedded in a page, and the ids matplotlib's SVG writer draws at random per figure
DATA_URI = re.compile(r"data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)")
SVG_ID = re.compile(r"(id=\"|url\(#|href=\"#)[A-Za-z]+[0-9a-f]{6,}")
OUTPUTS = ("demo_out", "gradients_out", "trajectory_out", "extra_out")

EXTRA = """
set -e
G=$VENV/bin/geomscope
$G report demo_out/report.json --html demo_out/report.html
$G extract bundled:minilm sample_data/sentences.txt --keep sample:200 --out extra_out/sample -q
$G score extra_out/sample --out extra_out/sample_report -q --id-sample 200
head -n 61 sample_data/sentiment/train.csv > extra_out/train.csv
$G finetune bundled:minilm --train extra_out/train.csv --eval sample_data/sentiment/dev.csv \
  --text-field sentence --label-field label --reg istar --lambda=-1 --epochs 1 --out extra_out/ft --quiet
$G plot extra_out/ft --out extra_out/ft_training.png
$G score demo_out/run --metrics all --id-sample 400 --out extra_out/all_report -q
$G plot extra_out/all_report.json --kind diagnostics --out extra_out/diagnostics.png
$G extract bundled:minilm sample_data/sentences.txt --modules attn_out,mlp_out --layers blocks \
  --out extra_out/modules -q
$G score extra_out/modules --out extra_out/modules_report -q --id-sample 200
$VENV/bin/python -c "import sys; sys.path.insert(0, 'tests'); from helpers_models import \
make_tiny_head_model as m; m('gpt_neox', 'causal-lm', 'extra_out')"
head -n 40 sample_data/sentences.txt > extra_out/lm.txt
$G finetune extra_out/tiny-gpt_neox-causal-lm --task causal-lm --train extra_out/lm.txt \
  --eval extra_out/lm.txt --reg istar --lambda=0.5 --epochs 1 --batch-size 8 --out extra_out/lm --quiet
"""


def run_commit(commit: str, work: Path, into: Path) -> None:
    """Check ``commit`` out in ``work``, run every command there and move the outputs to ``into``.
    Both commits run in the same ``work`` path, so the paths that outputs record agree."""
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(work), commit], check=True
    )
    try:
        env = {**os.environ, "PYTHONPATH": str(work), "VENV": str(VENV), "HF_HUB_OFFLINE": "1"}
        make = [
            "make",
            "-C",
            str(work),
            f"VENV={VENV}",
            "-o",
            f"{VENV}/.installed",
            "-o",
            f"{VENV}/.installed-test",
        ]
        for target in ("demo", "gradients", "trajectory"):
            subprocess.run([*make, target], check=True, env=env, stdout=subprocess.DEVNULL)
        (work / "extra_out").mkdir(exist_ok=True)
        subprocess.run(["bash", "-c", EXTRA], check=True, env=env, cwd=work, stdout=subprocess.DEVNULL)
        into.mkdir(parents=True)
        for name in OUTPUTS:
            shutil.move(str(work / name), str(into / name))
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(work)], check=False)


def _volatile(key: str) -> bool:
    return key in VOLATILE_KEYS or key.endswith(("_seconds", "_per_second"))


def _normal(value):
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items() if not _volatile(k)}
    if isinstance(value, list):
        return [_normal(v) for v in value]
    return value


def _text_form(path: Path):
    text = path.read_text(errors="replace")
    if path.suffix == ".json":
        return _normal(json.loads(text))
    if path.suffix == ".jsonl":
        return [_normal(json.loads(line)) for line in text.splitlines() if line.strip()]
    if path.suffix == ".html":
        svg = lambda m: SVG_ID.sub(r"\1<id>", base64.b64decode(m.group(1)).decode(errors="replace"))  # noqa: E731
        return TIMESTAMP.sub("<time>", DATA_URI.sub(svg, text))
    return text


def _h5_form(path: Path):
    import h5py
    import numpy as np

    items = {}

    def visit(name, obj):
        attrs = {k: np.asarray(v).tolist() for k, v in obj.attrs.items()}
        if isinstance(obj, h5py.Dataset):
            data = obj[()]
            items[name] = (str(obj.dtype), obj.shape, np.asarray(data).tobytes(), attrs)
        else:
            items[name] = attrs

    with h5py.File(path, "r") as f:
        f.visititems(visit)
        items["/"] = {k: np.asarray(v).tolist() for k, v in f.attrs.items()}
    return items


def same_file(a: Path, b: Path) -> bool:
    """Whether two outputs hold the same result (see the module's docstring for 'same')."""
    if a.suffix in (".json", ".jsonl", ".csv", ".txt", ".md", ".log", ".html"):
        return _text_form(a) == _text_form(b)
    if a.suffix == ".h5":
        return _h5_form(a) == _h5_form(b)
    return a.read_bytes() == b.read_bytes()


def compare_trees(a: Path, b: Path) -> list[str]:
    """One line per output that differs, is missing from one side or extra on it."""
    lines = []
    for name in OUTPUTS:
        files_a = {p.relative_to(a) for p in (a / name).rglob("*") if p.is_file()}
        files_b = {p.relative_to(b) for p in (b / name).rglob("*") if p.is_file()}
        lines += [f"only in base: {p}" for p in sorted(files_a - files_b)]
        lines += [f"only in head: {p}" for p in sorted(files_b - files_a)]
        for rel in sorted(files_a & files_b):
            if not same_file(a / rel, b / rel):
                lines.append(f"differs: {rel}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base")
    ap.add_argument("head", nargs="?", default="HEAD")
    ap.add_argument("--keep", type=Path, help="keep both commits' outputs under this folder")
    ap.add_argument("--compare-only", action="store_true", help="compare the outputs already under --keep")
    args = ap.parse_args()
    if args.compare_only:
        lines = compare_trees(args.keep / "base", args.keep / "head")
        print("\n".join(lines) if lines else "same outputs")
        return 1 if lines else 0
    top = args.keep or Path(tempfile.mkdtemp(prefix="geomscope-same-"))
    top.mkdir(parents=True, exist_ok=True)
    try:
        for side, commit in (("base", args.base), ("head", args.head)):
            print(f"{side}: {commit}", file=sys.stderr)
            run_commit(commit, top / "tree", top / side)
        lines = compare_trees(top / "base", top / "head")
    finally:
        if not args.keep:
            shutil.rmtree(top, ignore_errors=True)
    print("\n".join(lines) if lines else "same outputs")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
