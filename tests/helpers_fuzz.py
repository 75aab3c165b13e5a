"""Shared machinery of the hostile-input tests of the files geomscope reads back: a run directory
(its manifest.json and HDF5 shards, ``--keep all`` and ``--keep sample``: test_store_fuzz.py), a
score report (read by ``plot`` and ``report --html``: test_report_fuzz.py), a finetune output's
trainer state (read by ``finetune --resume``, with and without ``--dry-run``:
test_finetune_resume_fuzz.py) and a sweep (read by ``compare``: test_study_compare_fuzz.py).

Each example copies a clean output, applies ONE mutation and runs the command in-process through
the ``cli`` fixture. The contract: the command either succeeds with the clean output's numbers
(where the mutation leaves the data as it was, or could not be told from a run of other data) or
is refused with one ``error:`` line and a non-zero exit; never a traceback (an exception out of the
command fails the example) and never a hang (:data:`HANG_SECONDS`). A hostile run ships a manifest
whose checksums match its shards: the shard mutations recompute them with geomscope's own
checksum functions, so what stops them is the check of the shard's content, not the digest.

Hypothesis draws the mutations deterministically (``derandomize``), so a CI run repeats the same
examples; each class of mutation is its own parametrised test. The clean outputs are built once a
session (conftest's ``fuzz_runs`` and ``fuzz_sweep``: :func:`clean_runs`, :func:`clean_sweep`).
No test functions here.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import tempfile
from contextlib import contextmanager
from pathlib import Path

from conftest import assert_one_line_error
from helpers_models import make_tiny_run
from helpers_train import tiny_finetune_data
from hypothesis import HealthCheck, Phase
from hypothesis import strategies as st

from geomscope.report import save_report
from geomscope.score import score

#: how many times the hostile-input tests' examples to run: 1 in the test suite (~40 s on 2 busy
#: cores, the four modules together); a deeper
#: search, e.g. ``GEOMSCOPE_FUZZ_SCALE=10``, continues the same deterministic sequence of draws
SCALE = int(os.environ.get("GEOMSCOPE_FUZZ_SCALE", "1"))

#: an example that runs longer than this is a hang (the slowest clean command here takes ~2 s)
HANG_SECONDS = 60

FUZZ = dict(
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),  # a failing example is shown as drawn: one mutation
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# ------------------------------------------------------------------------------ running a command
class Hung(BaseException):
    """Raised in a command that runs past :data:`HANG_SECONDS` (a BaseException: no ``except
    Exception`` in the command swallows it)."""


@contextmanager
def no_hang(seconds: float = HANG_SECONDS):
    def hung(signum, frame):
        raise Hung(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_cmd(cli, args) -> tuple[int, str, str]:
    """``cli(args)`` within :data:`HANG_SECONDS`; an exception out of the command propagates (a
    traceback is a failure)."""
    with no_hang():
        return cli(args)


def refused_or(result, same) -> None:
    """The contract: exit 0 and then ``same()`` holds, or one ``error:`` line and a non-zero exit."""
    code, out, err = result
    if code == 0:
        same()
    else:
        assert_one_line_error(code, out, err)


@contextmanager
def workdir(root: Path):
    """A fresh folder under ``root`` for one example, removed after it."""
    d = Path(tempfile.mkdtemp(dir=root))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def plain_cli(args) -> int:
    """A command run in-process for a module's set-up (output not captured); its exit code."""
    from geomscope.cli import main

    try:
        main([str(a) for a in args])
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    return 0


# ------------------------------------------------------------------------------ JSON mutations
class Raw(str):
    """JSON text written as it is (NaN, a huge number, deep nesting)."""


class Pairs(list):
    """A JSON object whose keys may repeat: [(key, value), ...]."""


def dumps(v) -> str:
    """JSON text of ``v``, :class:`Raw` text and :class:`Pairs` objects included (it recurses as
    deep as the clean document nests; the deeply nested values are :class:`Raw`)."""
    if isinstance(v, Raw):
        return str(v)
    if isinstance(v, (dict, Pairs)):
        items = v.items() if isinstance(v, dict) else v
        return "{" + ",".join(f"{json.dumps(str(k))}:{dumps(x)}" for k, x in items) + "}"
    if isinstance(v, list):
        return "[" + ",".join(dumps(x) for x in v) + "]"
    return json.dumps(v)


def nested(depth: int) -> Raw:
    """Arrays nested ``depth`` deep."""
    return Raw("[" * depth + "]" * depth)


LONG_TEXT = "x" * 100_000

#: values no field of a file geomscope writes holds
HOSTILE = (
    None,
    True,
    False,
    0,
    -1,
    -(2**63) - 1,
    2**64,
    0.5,
    -0.0,
    1e308,
    Raw("1e400"),
    Raw("NaN"),
    Raw("-Infinity"),
    Raw("9" * 5000),
    "",
    LONG_TEXT,
    "\x00",
    "\ud800",
    "\x1b]0;title\x07",
    "../../outside",
    "/etc/passwd",
    "shard-00001.h5",
    [],
    {},
    [None],
    {"": None},
    nested(101),
    nested(100_000),
    Raw('{"a":' * 1000 + "1" + "}" * 1000),
)


def variants(v) -> list:
    """Values near ``v``: one step off, another type, another shape."""
    if isinstance(v, bool):
        return [not v, int(v), str(v).lower(), None]
    if isinstance(v, int):
        return [v + 1, v - 1, -v - 1, v * 2**20 + 7, float(v), str(v), [v], True]
    if isinstance(v, float):
        return [v * 2, -v, v + 1e-9, Raw("NaN"), int(v), str(v), [v]]
    if isinstance(v, str):
        return [v + "x", v[:-1], v.upper(), "", v + "/../x", v * 3, [v], 1]
    if isinstance(v, list):
        return [[], v[::-1], v + v[:1], v[1:], {"0": v}, len(v)]
    if isinstance(v, dict):
        return [{}, {**v, "zz_unknown": 1}, list(v.values()), Pairs([*v.items(), *v.items()])]
    return [0, "", {}]


def paths_of(doc, at=()) -> list[tuple]:
    """Every place in a parsed JSON document, as key paths from the root (the root left out)."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    found = []
    for k, v in items:
        found.append((*at, k))
        found.extend(paths_of(v, (*at, k)))
    return found


def at_path(doc, path):
    for k in path:
        doc = doc[k]
    return doc


TEXT_MUTATIONS = ("empty", "half", "last byte cut", "garbage after", "bom", "invalid utf-8", "utf-16", "null")


def mutated_text(text: str, how: str) -> bytes:
    b = text.encode()
    return {
        "empty": b"",
        "half": b[: len(b) // 2],
        "last byte cut": b[:-1],
        "garbage after": b + b"\x00}]garbage",
        "bom": b"\xef\xbb\xbf" + b,
        "invalid utf-8": b.replace(b'"', b'"\xff', 1),
        "utf-16": text.encode("utf-16"),
        "null": b"null",
    }[how]


JSON_OPS = ("delete", "hostile", "variant", "duplicate", "text")


def shown(v) -> str:
    return repr(v)[:60]


def replaced(doc, path: tuple, value):
    """``doc`` with the value at ``path`` replaced (``value`` itself for the root)."""
    if not path:
        return value
    at_path(doc, path[:-1])[path[-1]] = value
    return doc


def draw_json_mutation(data, doc, op: str, paths=None) -> tuple[bytes, str]:
    """One mutation of the parsed document ``doc`` of class ``op`` (:data:`JSON_OPS`) at one of
    ``paths`` (default: anywhere), drawn from ``data``: the new file's bytes and what was done."""
    if op == "text":
        how = data.draw(st.sampled_from(TEXT_MUTATIONS), label="text")
        return mutated_text(json.dumps(doc, indent=2), how), f"text: {how}"
    doc = json.loads(json.dumps(doc))
    path = data.draw(st.sampled_from(paths or paths_of(doc)), label="path")
    parent, key = at_path(doc, path[:-1]), path[-1]
    if op == "delete":
        del parent[key]
        what = "deleted"
    elif op in ("hostile", "variant"):
        pool = HOSTILE if op == "hostile" else variants(parent[key])
        parent[key] = data.draw(st.sampled_from(pool), label="value")
        what = f"= {shown(parent[key])}"
    elif isinstance(parent, list):
        parent.insert(key, parent[key])
        what = "item twice"
    else:  # a key twice: json keeps the last one
        value = data.draw(st.sampled_from(HOSTILE), label="value")
        first = data.draw(st.booleans(), label="hostile first")
        pairs = [(key, value), *parent.items()] if first else [*parent.items(), (key, value)]
        doc = replaced(doc, path[:-1], Pairs(pairs))
        what = f"key twice, {'first' if first else 'last'} = {shown(value)}"
    return dumps(doc).encode(), f"{op} {path}: {what}"


# ------------------------------------------------------------------------------ report numbers
def layer_numbers(report: dict) -> dict:
    """{(layer, key path): number} of every layer's numbers (its index and notes left out)."""
    found = {}

    def walk(v, at):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(x, (*at, k))
        elif isinstance(v, list):
            for i, x in enumerate(v):
                walk(x, (*at, i))
        elif v is None or isinstance(v, (int, float)):
            found[at] = v

    for layer in report["layers"]:
        walk({k: v for k, v in layer.items() if k not in ("index", "notes", "layer")}, (layer["layer"],))
    return found


def same_numbers(got: dict, clean: dict) -> None:
    """Every number of ``got`` is ``clean``'s (to 1e-9: shards merged in another order); a layer
    the mutation left out may be missing, none may be added."""
    layers = {k[0] for k in got}
    wanted = {k: v for k, v in clean.items() if k[0] in layers}
    assert got.keys() == wanted.keys(), sorted(set(got) ^ set(wanted))[:5]
    for k, v in got.items():
        c = wanted[k]
        if v is None or c is None or isinstance(v, bool):
            assert v == c, (k, v, c)
        else:
            assert math.isclose(v, c, rel_tol=1e-9, abs_tol=1e-12), (k, v, c)


# ------------------------------------------------------------------------------ clean outputs
class Clean(dict):
    """A module's clean outputs, shown briefly in a failing example."""

    def __repr__(self) -> str:
        return f"<clean outputs in {self['dir']}>"


def clean_runs(tmp_path_factory) -> Clean:
    """A tiny BERT's run of 12 documents in 3 shards, kept whole (``all``) and as accumulators with
    a 40-row sample (``sample``), each with its layers' numbers as ``score`` reports them."""
    d = tmp_path_factory.mktemp("fuzz-runs")
    made = {
        "all": make_tiny_run(d, shard_docs=4),
        "sample": make_tiny_run(d, name="run-sample", shard_docs=4, keep="sample:40"),
    }
    reports = {kind: json.loads(json.dumps(score(str(run)))) for kind, run in made.items()}
    save_report(reports["all"], d / "report" / "report.json")
    return Clean(
        dir=d,
        runs=made,
        numbers={kind: layer_numbers(r) for kind, r in reports.items()},
        report=d / "report" / "report.json",
    )


def clean_sweep(tmp_path_factory) -> Clean:
    """A finetune sweep of 2 lambdas x 2 seeds (one CPU epoch each) of a tiny checkpoint, its
    compare output, and one point resumed for a second epoch (what a mutated resume must match)."""
    d = tmp_path_factory.mktemp("fuzz-sweep")
    data = tiny_finetune_data(d)
    assert plain_cli(finetune_cmd(data, d / "sweep", "0,1", "0,1", epochs=1)) == 0
    point = d / "sweep" / "istar_lambda0_seed0"
    resumed = d / "resumed"
    shutil.copytree(point, resumed)
    assert plain_cli([*finetune_cmd(data, resumed, "0", "0", epochs=2), "--resume"]) == 0
    assert plain_cli(compare_cmd(d / "sweep", d / "compare")) == 0
    return Clean(
        dir=d,
        data=data,
        sweep=d / "sweep",
        point=point,
        resumed=resumed_numbers(resumed),
        compare=compare_numbers(d / "compare" / "compare.json"),
    )


def finetune_cmd(data: dict, out: Path, lam: str, seed: str, *, epochs: int) -> list:
    return [
        "finetune",
        data["model"],
        "--train",
        data["train"],
        "--eval",
        data["eval"],
        "--out",
        out,
        "--epochs",
        epochs,
        "--batch-size",
        "8",
        "--lr",
        "1e-3",
        "--device",
        "cpu",
        "--quiet",
        "--reg",
        "istar",
        "--lambda",
        lam,
        "--seed",
        seed,
    ]


def compare_cmd(sweep_dir: Path, out: Path) -> list:
    return ["compare", sweep_dir, "--out", out, "--bootstrap", "100", "--quiet"]


def resumed_numbers(out: Path) -> dict:
    """What a resumed run's summary says of its training: steps, epochs and final eval numbers."""
    s = json.loads((out / "summary.json").read_text())
    return {"steps": s["steps"], "epochs": s["epochs"], "final": s["final"]}


def compare_numbers(path: Path) -> dict:
    """compare.json without the run directories (a copy of the sweep is elsewhere)."""
    result = json.loads(path.read_text(), parse_constant=not_json)
    for r in result["runs"]:
        r.pop("dir")
    return result


def not_json(name):
    raise AssertionError(f"{name} in a report: not JSON")
