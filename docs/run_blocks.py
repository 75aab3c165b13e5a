"""Run every ```bash block of the README, the tutorials and the how-to guides, so the docs cannot
drift from the code.

Each block runs as ``bash -euo pipefail`` in the repository root, with ``.venv/bin`` first on PATH
and the hub switched off (``HF_HUB_OFFLINE=1``): a block either runs green here, at the size of the
bundled model and ``sample_data/``, or says why it cannot with a marker on the line before it::

    <!-- skip-ci: needs a GPU -->

The reason is required. The blocks of one file run in order (a later block may read what an earlier
one wrote) and stop at that file's first failure; the other files still run. A failure names the
file and the line of the block's opening fence and shows the end of its output; the exit status is
then 1. Blocks write under ``docs_out/`` (ignored by git), which is emptied before a run; each file
keeps to its own folder there, so files do not depend on one another.

``--jobs N`` runs N files at a time, each block then with cpu_count // N threads (OMP_NUM_THREADS,
which torch and numpy's BLAS read; at least 1, and left alone where the caller set it). Most of a
block's time is a command starting (imports, the model loaded) and small products that two threads
barely speed up, so on 2 cores two files of one thread each finish sooner than one file of two.
Thread counts can move a training run's last digits, so the outputs a page quotes come from the
default, one file at a time.

Usage: ``python docs/run_blocks.py [FILE ...] [--list] [--verbose] [--jobs N]`` (no FILE:
README.md, docs/tutorials/*.md, docs/how-to/*.md). ``make docs`` runs it after the site builds;
``--verbose`` shows each block's output, which the pages' "expected output" quotes.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRATCH = ROOT / "docs_out"
SKIP = re.compile(r"^<!--\s*skip-ci:(?P<reason>.*?)-->\s*$")
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
TAIL_LINES = 40
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@dataclass(frozen=True)
class Block:
    """One fenced bash block: where its opening fence is, its text, and why it is skipped (or None)."""

    path: Path
    line: int
    code: str
    skip: str | None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path}:{self.line}"


class MarkerError(ValueError):
    """A skip-ci marker without a reason, or one that no bash block follows."""


def default_files() -> list[Path]:
    docs = ROOT / "docs"
    return [
        ROOT / "README.md",
        *sorted((docs / "tutorials").glob("*.md")),
        *sorted((docs / "how-to").glob("*.md")),
    ]


def bash_blocks(path: Path) -> list[Block]:
    """The ```bash blocks of one Markdown file, in order, with the skip-ci marker of each.

    A marker counts when it is the last non-blank line before the opening fence. Other fenced blocks
    (text, python, yaml, console) are stepped over whole, so a fence inside them is not read as one.
    """
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    pending: tuple[int, str] | None = None  # (line, reason) of a marker waiting for its block
    i = 0
    while i < len(lines):
        marker = SKIP.match(lines[i].strip())
        fence = FENCE.match(lines[i])
        if marker:
            reason = marker["reason"].strip()
            if not reason:
                raise MarkerError(f"{path}:{i + 1}: a skip-ci marker needs a reason (<!-- skip-ci: why -->)")
            if pending:
                raise MarkerError(f"{path}:{pending[0]}: a skip-ci marker with no bash block after it")
            pending = (i + 1, reason)
        elif fence:
            end = _closing_fence(lines, i, fence["fence"], path)
            is_bash = fence["info"].strip().split(" ")[0] in ("bash", "sh")
            if pending and not is_bash:
                raise MarkerError(f"{path}:{pending[0]}: a skip-ci marker before a block that is not bash")
            if is_bash:
                body = "\n".join(line[len(fence["indent"]) :] for line in lines[i + 1 : end])
                blocks.append(Block(path, i + 1, body + "\n", pending[1] if pending else None))
            pending = None
            i = end
        elif lines[i].strip() and pending:
            raise MarkerError(f"{path}:{pending[0]}: a skip-ci marker with no bash block after it")
        i += 1
    if pending:
        raise MarkerError(f"{path}:{pending[0]}: a skip-ci marker with no bash block after it")
    return blocks


def _closing_fence(lines: list[str], start: int, fence: str, path: Path) -> int:
    for j in range(start + 1, len(lines)):
        stripped = lines[j].strip()
        if stripped.startswith(fence[0] * len(fence)) and set(stripped) == {fence[0]}:
            return j
    raise MarkerError(f"{path}:{start + 1}: a code block that is never closed")


def block_env(jobs: int = 1) -> dict[str, str]:
    """The environment each block runs in: the project's venv first, no hub, no display; with
    ``jobs`` > 1 files at a time, each block's share of the cores as its thread count."""
    env = dict(os.environ)
    if jobs > 1 and not any(name in env for name in THREAD_VARS):
        env.update(dict.fromkeys(THREAD_VARS, str(max(1, (os.cpu_count() or 1) // jobs))))
    env["PATH"] = f"{ROOT / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(ROOT / ".venv")
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        MPLBACKEND="Agg",
        NO_COLOR="1",
    )
    return env


def run_block(block: Block, env: dict[str, str]) -> tuple[int, str, float]:
    """Run one block; its exit status, its interleaved stdout and stderr, and the seconds it took."""
    start = time.perf_counter()
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.code],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    return proc.returncode, proc.stdout, time.perf_counter() - start


def run_file(path: Path, env: dict[str, str], *, say=print, verbose: bool = False) -> tuple[int, list[str]]:
    """Run one file's blocks in order: how many passed, and its failure (at most one: the file stops
    there, as its later blocks may need what the failed one did not make)."""
    passed = 0
    for block in bash_blocks(path):
        if block.skip:
            say(f"skip  {block.where}  ({block.skip})")
            continue
        status, output, seconds = run_block(block, env)
        if status == 0:
            passed += 1
            say(f"ok    {block.where}  {seconds:.1f} s" + (f"\n{output.rstrip()}" if verbose else ""))
            continue
        tail = "\n".join(output.rstrip().splitlines()[-TAIL_LINES:])
        say(f"FAIL  {block.where}  exit {status} after {seconds:.1f} s; the end of its output:\n{tail}")
        return passed, [f"{block.where}: the bash block exited with status {status}"]
    return passed, []


def run_files(paths: list[Path], *, say=print, verbose: bool = False, jobs: int = 1) -> tuple[int, list[str]]:
    """Run the blocks of every file, ``jobs`` files at a time: how many passed, and the failures, one
    ``FILE:LINE: why`` each, in the order of ``paths``.

    ``verbose`` also shows each passing block's output (what a page's "expected output" quotes); a
    block's lines are said together, so files running side by side do not interleave within one.
    """
    env = block_env(jobs)
    lock = threading.Lock()

    def say_whole(text: str) -> None:
        with lock:
            say(text)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        results = list(pool.map(lambda p: run_file(p, env, say=say_whole, verbose=verbose), paths))
    return sum(n for n, _ in results), [f for _, failed in results for f in failed]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "files", nargs="*", type=Path, help="Markdown files (default: README, tutorials, how-to)"
    )
    parser.add_argument("--list", action="store_true", help="list the blocks and their markers; run nothing")
    parser.add_argument("-v", "--verbose", action="store_true", help="show every block's output")
    parser.add_argument(
        "-j", "--jobs", type=int, default=1, metavar="N", help="files run at a time (default 1)"
    )
    args = parser.parse_args(argv)
    if args.jobs < 1:
        print(f"error: --jobs takes a count of at least 1, not {args.jobs}", file=sys.stderr)
        return 2
    paths = [p.resolve() for p in args.files] or default_files()
    try:
        blocks = [b for p in paths for b in bash_blocks(p)]
    except MarkerError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if args.list:
        for b in blocks:
            print(f"{'skip' if b.skip else 'run '}  {b.where}" + (f"  ({b.skip})" if b.skip else ""))
        return 0
    shutil.rmtree(SCRATCH, ignore_errors=True)
    start = time.perf_counter()
    passed, failures = run_files(paths, verbose=args.verbose, jobs=args.jobs)
    for line in failures:
        print(f"error: {line}", file=sys.stderr)
    skipped = sum(b.skip is not None for b in blocks)
    print(f"{len(paths)} files, {time.perf_counter() - start:.0f} s")
    # the closing line a CI log reader counts: "N passed, N failed, N skipped"
    print(f"blocks: {passed} passed, {len(failures)} failed, {skipped} skipped")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
