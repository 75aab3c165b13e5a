"""Fuzz test of the files geomscope reads back: a run directory (its manifest.json and HDF5 shards,
``--keep all`` and ``--keep sample``), a score report (read by ``plot`` and ``report --html``), a
finetune output's trainer state (read by ``finetune --resume``, with and without ``--dry-run``) and
a sweep (read by ``compare``).

Each example copies a clean output, applies ONE mutation and runs the command in-process through
the ``cli`` fixture. The contract: the command either succeeds with the clean output's numbers
(where the mutation leaves the data as it was, or could not be told from a run of other data) or
is refused with one ``error:`` line and a non-zero exit; never a traceback (an exception out of the
command fails the example) and never a hang (:data:`HANG_SECONDS`). A hostile run ships a manifest
whose checksums match its shards: the shard mutations recompute them with geomscope's own
checksum functions, so what stops them is the check of the shard's content, not the digest.

Hypothesis draws the mutations deterministically (``derandomize``), so a CI run repeats the same
examples; each class of mutation is its own parametrised test.
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

import h5py
import numpy as np
import pytest
from conftest import assert_one_line_error
from helpers_models import make_tiny_run
from helpers_train import tiny_finetune_data
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

from geomscope.report import save_report
from geomscope.score import score
from geomscope.store import checksum

#: how many times the examples below to run: 1 in the test suite (~40 s on 2 busy cores); a deeper
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


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
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


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
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
    result = json.loads(path.read_text(), parse_constant=_not_json)
    for r in result["runs"]:
        r.pop("dir")
    return result


# ------------------------------------------------------------------------------ score of a run
def score_cmd(cli, run: Path, w: Path) -> tuple[int, str, str]:
    return run_cmd(cli, ["score", run, "--out", w / "rep", "--quiet"])


def scored(w: Path) -> dict:
    """The numbers of the report ``score_cmd`` wrote (strict JSON: non-finite numbers are null)."""
    return layer_numbers(json.loads((w / "rep.json").read_text(), parse_constant=_not_json))


def _not_json(name):
    raise AssertionError(f"{name} in a report: not JSON")


def check_score(cli, runs, kind: str, run: Path, w: Path, *, same: bool) -> None:
    """``score`` of the mutated ``run``: refused in one line, or the clean run's numbers (``same``;
    otherwise any report that is strict JSON)."""
    clean = runs["numbers"][kind]
    refused_or(score_cmd(cli, run, w), lambda: same_numbers(scored(w), clean) if same else scored(w))


def copy_run(runs, kind: str, w: Path) -> Path:
    return Path(shutil.copytree(runs["runs"][kind], w / "run"))


def shard_names(run: Path) -> list[str]:
    return [s["file"] for s in json.loads((run / "manifest.json").read_text())["shards"]]


# ------------------------------------------------------------------------------ manifest mutations
MANIFEST_OPS = (*JSON_OPS, "shard entries", "shard file", "checksum")


def draw_manifest_mutation(data, m: dict, op: str, run: Path, other: Path) -> tuple[bytes, str, bool]:
    """(new manifest bytes, what was done, whether the numbers must stay the clean run's)."""
    if op in JSON_OPS:
        return (*draw_json_mutation(data, m, op), True)
    shards = m["shards"]
    i = data.draw(st.integers(0, len(shards) - 1), label="shard")
    if op == "shard entries":
        how = data.draw(st.sampled_from(["twice", "swapped", "reversed", "dropped"]), label="how")
        j = (i + 1) % len(shards)
        if how == "twice":
            shards.insert(j, dict(shards[i]))
        elif how == "swapped":
            shards[i], shards[j] = shards[j], shards[i]
        elif how == "reversed":
            shards.reverse()
        else:  # a smaller run: its numbers are another run's
            del shards[i]
        return json.dumps(m).encode(), f"shards[{i}] {how}", how != "dropped"
    if op == "shard file":
        name = shards[i]["file"]
        outside = [f"../{run.name}/{name}", str(other / name), f"./{name}", f"{name}/", name.upper()]
        outside += [f"{name}\x00", "shard-9.h5", "shard-00009.h5", "manifest.json", "layers", ""]
        outside += [s["file"] for s in shards if s["file"] != name]
        shards[i]["file"] = data.draw(st.sampled_from(outside), label="file")
        return json.dumps(m).encode(), f"shards[{i}].file = {shards[i]['file']!r}", True
    algorithm = data.draw(st.sampled_from([checksum.SLOW, checksum.FAST]), label="algorithm")
    how = data.draw(
        st.sampled_from(["another shard's", "one digit off", "deleted", "upper case"]), label="how"
    )
    value = shards[i][algorithm]
    if how == "deleted":
        del shards[i][algorithm]
    else:
        shards[i][algorithm] = {
            "another shard's": shards[(i + 1) % len(shards)][algorithm],
            "one digit off": value[:-1] + ("0" if value[-1] != "0" else "1"),
            "upper case": value.upper(),
        }[how]
    return json.dumps(m).encode(), f"shards[{i}].{algorithm} {how}", True


@pytest.mark.parametrize("op", MANIFEST_OPS)
@settings(max_examples=6 * SCALE, **FUZZ)
@given(data=st.data())
def test_a_mutated_manifest_scores_the_same_or_is_refused(cli, runs, tmp_path, op, data):
    kind = data.draw(st.sampled_from(["all", "sample"]), label="run")
    with workdir(tmp_path) as w:
        run = copy_run(runs, kind, w)
        other = runs["runs"]["sample" if kind == "all" else "all"]
        m = json.loads((run / "manifest.json").read_text())
        text, what, same = draw_manifest_mutation(data, m, op, run, other)
        note(what)
        (run / "manifest.json").write_bytes(text)
        check_score(cli, runs, kind, run, w, same=same)


# ------------------------------------------------------------------------------ shard mutations
def reseal(run: Path, name: str) -> None:
    """Record the shard's present size and checksums in the manifest (geomscope's own digests):
    what a hostile run ships, so that only the content checks can refuse it."""
    m = json.loads((run / "manifest.json").read_text())
    entry = next(s for s in m["shards"] if s["file"] == name)
    entry.update(checksum.digests(run / name))
    entry["bytes"] = (run / name).stat().st_size
    (run / "manifest.json").write_text(json.dumps(m))


def contents(f: h5py.File) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """(datasets, groups, (object, attribute) pairs) of an open HDF5 file."""
    datasets, groups, attrs = [], [], [("/", a) for a in f.attrs]

    def visit(name, obj):
        (datasets if isinstance(obj, h5py.Dataset) else groups).append(name)
        attrs.extend((name, a) for a in obj.attrs)

    f.visititems(visit)
    return datasets, groups, attrs


def dtype_choices(dt: np.dtype) -> list[str]:
    if dt.kind == "f":
        return ["<f4", "<f8", ">f2", ">f8", "<i2", "|u1", "|b1", "<c8", "S8"]
    if dt.kind in "iu":
        return ["<i4", "<u8", "<f8", ">i8", "<f2", "|b1", "S8"]
    return ["|u1", "<i8", "<f4", "S1"]


def shape_choices(shape: tuple) -> list[tuple]:
    n = shape[0]
    rest = shape[1:]
    wider = [(n, rest[0] - 1), (n, rest[0] + 1), (n * rest[0],)] if rest else [(n, 1)]
    return [(n - 1, *rest), (n + 1, *rest), (0, *rest), (n, *rest, 1), (), *wider]


def replace_dataset(f: h5py.File, name: str, new, **kw) -> None:
    del f[name]
    f.create_dataset(name, data=new, **kw)


def lossless(old: np.ndarray, new: np.ndarray) -> bool:
    """Whether ``new`` holds ``old``'s numbers exactly (another width or byte order)."""
    if new.dtype.kind not in "biuf":
        return False
    with np.errstate(all="ignore"):
        return bool(np.array_equal(new.astype(old.dtype), old))


def changed_values(data, old: np.ndarray, name: str) -> tuple[np.ndarray, str, bool]:
    """``old`` with one element changed: (new, how, whether the numbers must stay the clean run's:
    a NaN or an infinity no flag declares, an index no document has, must be refused)."""
    new = old.copy()
    flat = new.reshape(-1)
    k = data.draw(st.integers(0, flat.size - 1), label="element")
    if old.dtype.kind == "b":
        flat[k] = not flat[k]
        return new, "one flag flipped", False
    if old.dtype.kind in "iu":
        how = data.draw(st.sampled_from(["-1", "2**62", "+1"]), label="how")
        flat[k] = {"-1": -1, "2**62": 2**62, "+1": flat[k] + 1}[how]
        # a document or a count no shard holds is refused; a token's id and position are the row's
        # name (its sample key), not checked against the model: another value is another run's row
        return new, f"{name}[{k}] {how}", how != "+1" and name not in ("position", "token_id")
    how = data.draw(st.sampled_from(["nan", "inf", "zero", "negated", "largest"]), label="how")
    flat[k] = {
        "nan": np.nan,
        "inf": np.inf,
        "zero": 0,
        "negated": -flat[k],
        "largest": np.finfo(old.dtype).max,
    }[how]
    return new, f"{name}[{k}] {how}", how in ("nan", "inf")


def attribute_choices(value) -> list:
    if isinstance(value, np.ndarray):  # layer_names
        names = [str(x) for x in value]
        return [names[:-1], names[::-1], [*names, "layer_99"], [names[0]] * len(names), [1, 2, 3]]
    if isinstance(value, (str, bytes)):
        return ["", "x", "all", "sample", str(value) + "x", 1]
    if isinstance(value, (np.floating, float)):
        return [np.nan, np.inf, -float(value), 2 * float(value) + 1, 0.0]
    v = int(value)
    return [v + 1, v - 1, -1, 2**62, float(v) + 0.5, "1", 0]


def mutate_structure(data, f: h5py.File, op: str) -> tuple[str, bool]:
    """One structural change to the open shard ``f``: (what was done, whether the numbers must
    stay the clean run's)."""
    datasets, groups, attrs = contents(f)
    if op == "delete":
        target = data.draw(
            st.sampled_from([*datasets, *groups, *(f"{o}@{a}" for o, a in attrs)]), label="what"
        )
        obj, _, attr = target.partition("@")
        if attr:
            del f[obj].attrs[attr]
        else:
            del f[obj]
        return f"deleted {target}", True
    if op == "attribute":
        obj, attr = data.draw(st.sampled_from(attrs), label="attribute")
        old = f[obj].attrs[attr]
        value = data.draw(st.sampled_from(attribute_choices(old)), label="value")
        f[obj].attrs[attr] = (
            np.array(value, dtype=h5py.string_dtype())
            if isinstance(value, list) and value and isinstance(value[0], str)
            else value
        )
        finite_float = isinstance(old, (np.floating, float)) and math.isfinite(float(value))
        return f"{obj}@{attr} = {shown(value)}", not finite_float
    if op == "extra":
        how = data.draw(st.sampled_from(["layer", "dataset", "attribute", "group"]), label="how")
        if how == "layer":
            f.create_dataset("layers/layer_99", data=f["layers/layer_00"][()])
        elif how == "dataset":
            f.create_dataset("zz_extra", data=np.arange(3))
        elif how == "attribute":
            f.attrs["zz_extra"] = "x" * 10_000
        else:
            f.create_group("accumulators/zz_extra" if "accumulators" in f else "zz_extra")
        return f"extra {how}", True
    name = data.draw(st.sampled_from(datasets), label="dataset")
    old = f[name][()]
    if op == "dtype":
        new = old.astype(data.draw(st.sampled_from(dtype_choices(old.dtype)), label="dtype"))
        replace_dataset(f, name, new)
        return f"{name} as {new.dtype}", lossless(old, new)
    if op == "shape":
        shape = data.draw(st.sampled_from(shape_choices(old.shape)), label="shape")
        replace_dataset(f, name, np.resize(old, shape) if shape else old.reshape(-1)[0])
        return f"{name} of shape {shape}", True
    if op == "values":
        new, how, same = changed_values(data, old, name)
        replace_dataset(f, name, new)
        return how, same
    replace_dataset(f, name, old, chunks=True, compression="gzip", compression_opts=9, shuffle=True)
    return f"{name} gzip-compressed", True


SHARD_OPS = (
    "not a file",
    "truncate",
    "flip bytes",
    "another shard",
    "delete",
    "attribute",
    "extra",
    "dtype",
    "shape",
    "values",
    "compressed",
)


def mutate_shard(data, run: Path, op: str) -> tuple[str, bool]:
    """One mutation of one shard of ``run`` (resealed where a hostile run would be): (what was
    done, whether the numbers must stay the clean run's)."""
    names = shard_names(run)
    i = data.draw(st.integers(0, len(names) - 1), label="shard")
    path = run / names[i]
    if op == "not a file":
        how = data.draw(st.sampled_from(["folder", "link to its copy", "link to another shard"]), label="how")
        twin = path.with_name("elsewhere.h5")
        shutil.copyfile(run / names[(i + 1) % len(names)] if how.endswith("shard") else path, twin)
        path.unlink()
        path.mkdir() if how == "folder" else path.symlink_to(twin)
        return f"{names[i]}: {how}", True
    if op in ("truncate", "flip bytes", "another shard"):
        blob = path.read_bytes()
        resealed = data.draw(st.booleans(), label="resealed")
        k = data.draw(st.integers(0, len(blob) - 1), label="offset")
        if op == "truncate":
            path.write_bytes(blob[:k])
        elif op == "flip bytes":
            mask = data.draw(st.integers(1, 255), label="mask")
            path.write_bytes(blob[:k] + bytes([blob[k] ^ mask]) + blob[k + 1 :])
        else:
            shutil.copyfile(run / names[(i + 1) % len(names)], path)
        if resealed:
            reseal(run, names[i])
        # a flipped byte in a resealed shard may be a value of another run's data
        return f"{names[i]}: {op} at {k}, resealed {resealed}", not (resealed and op == "flip bytes")
    with h5py.File(path, "r+") as f:
        what, same = mutate_structure(data, f, op)
    reseal(run, names[i])
    return f"{names[i]}: {what}", same


@pytest.mark.parametrize("op", SHARD_OPS)
@settings(max_examples=6 * SCALE, **FUZZ)
@given(data=st.data())
def test_a_mutated_shard_scores_the_same_or_is_refused(cli, runs, tmp_path, op, data):
    kind = data.draw(st.sampled_from(["all", "sample"]), label="run")
    with workdir(tmp_path) as w:
        run = copy_run(runs, kind, w)
        what, same = mutate_shard(data, run, op)
        note(what)
        check_score(cli, runs, kind, run, w, same=same)


# ------------------------------------------------------------------------------ a report
def report_paths(doc) -> list[tuple]:
    """Every place in a report but the second and later items of its lists (eigenvalues, outlier
    statistics: one place each is enough)."""
    return [p for p in paths_of(doc) if all(not isinstance(k, int) or k < 2 for k in p)]


@pytest.mark.parametrize("command", ["plot", "report --html"])
@settings(max_examples=4 * SCALE, **FUZZ)
@given(data=st.data())
def test_a_mutated_report_is_drawn_or_refused(cli, runs, tmp_path, command, data):
    op = data.draw(st.sampled_from(JSON_OPS), label="op")
    doc = json.loads(runs["report"].read_text())
    with workdir(tmp_path) as w:
        text, what = draw_json_mutation(data, doc, op, report_paths(doc))
        note(what)
        (w / "report.json").write_bytes(text)
        drawn = w / ("figure.png" if command == "plot" else "page.html")
        args = (
            ["plot", w / "report.json", "--out", drawn]
            if command == "plot"
            else ["report", w / "report.json", "--html", drawn]
        )
        refused_or(run_cmd(cli, [*args, "--quiet"]), lambda: drawn.is_file())


# ------------------------------------------------------------------------------ a trainer state
def mutated_safetensors(data, blob: bytes) -> tuple[bytes, str]:
    """A safetensors file with its length field, its JSON header or its bytes changed."""
    n = int.from_bytes(blob[:8], "little")
    how = data.draw(st.sampled_from(["header", "length", "truncate"]), label="how")
    if how == "truncate":
        k = data.draw(st.integers(0, len(blob) - 1), label="offset")
        return blob[:k], f"truncated at {k}"
    if how == "length":
        value = data.draw(st.sampled_from([0, n - 1, n + 1, len(blob), 2**63, 2**64 - 1]), label="length")
        return value.to_bytes(8, "little") + blob[8:], f"header length {value}"
    op = data.draw(st.sampled_from(JSON_OPS), label="op")
    header, what = draw_json_mutation(data, json.loads(blob[8 : 8 + n]), op)
    return len(header).to_bytes(8, "little") + header + blob[8 + n :], f"header: {what}"


TRAINER_FILES = (
    "checkpoint/state.json",
    "checkpoint/trainer.json",
    "checkpoint/trainer.safetensors",
    ".geomscope-finetune.json",
)


@pytest.mark.parametrize("name", TRAINER_FILES)
@settings(max_examples=6 * SCALE, **FUZZ)
@given(data=st.data())
def test_a_mutated_trainer_state_resumes_the_same_or_is_refused(cli, sweep, tmp_path, name, data):
    with workdir(tmp_path) as w:
        out = Path(shutil.copytree(sweep["point"], w / "run"))
        beside = w / "notes.txt"  # a user's file next to the run: never touched
        beside.write_text("mine")
        blob = (out / name).read_bytes()
        if name.endswith(".safetensors"):
            text, what = mutated_safetensors(data, blob)
        else:
            text, what = draw_json_mutation(
                data, json.loads(blob), data.draw(st.sampled_from(JSON_OPS), label="op")
            )
        note(what)
        (out / name).write_bytes(text)
        args = [*finetune_cmd(sweep["data"], out, "0", "0", epochs=2), "--resume"]
        dry = run_cmd(cli, [*args, "--dry-run"])
        refused_or(dry, lambda: None)
        resumed = run_cmd(cli, args)
        refused_or(resumed, lambda: resumed_numbers(out) == sweep["resumed"])
        assert dry[0] == 0 or resumed[0] != 0, "the dry run refused what the run accepts"
        assert beside.read_text() == "mine"


# ------------------------------------------------------------------------------ a sweep
COMPARE_FILES = ("sweep.json", "summary.json", "run.json", "checkpoint/state.json")


@pytest.mark.parametrize("name", COMPARE_FILES)
@settings(max_examples=2 * SCALE, **FUZZ)
@given(data=st.data())
def test_a_mutated_sweep_compares_the_same_or_is_refused(cli, sweep, tmp_path, name, data):
    with workdir(tmp_path) as w:
        copy = Path(shutil.copytree(sweep["sweep"], w / "sweep"))
        points = sorted(p.name for p in copy.iterdir() if p.is_dir())
        where = copy if name == "sweep.json" else copy / data.draw(st.sampled_from(points), label="run")
        op = data.draw(st.sampled_from(JSON_OPS), label="op")
        text, what = draw_json_mutation(data, json.loads((where / name).read_text()), op)
        note(f"{where.name}/{name}: {what}")
        (where / name).write_bytes(text)

        def same_or_strict():
            result = compare_numbers(w / "cmp" / "compare.json")  # strict JSON, parsed
            if name == "sweep.json":  # compare reads the runs, not the grid they were planned from
                assert result == sweep["compare"]

        refused_or(run_cmd(cli, compare_cmd(copy, w / "cmp")), same_or_strict)


@pytest.mark.parametrize("op", SHARD_OPS)
@settings(max_examples=3 * SCALE, **FUZZ)
@given(data=st.data())
def test_inspect_verify_refuses_the_mutated_shards_score_refuses(cli, runs, tmp_path, op, data):
    """One notion of a valid shard: ``inspect --verify`` passes a shard exactly when ``score``
    reads it."""
    kind = data.draw(st.sampled_from(["all", "sample"]), label="run")
    with workdir(tmp_path) as w:
        run = copy_run(runs, kind, w)
        what, _ = mutate_shard(data, run, op)
        note(what)
        verified = run_cmd(cli, ["inspect", run, "--verify", "--json"])
        described = json.loads(verified[1], parse_constant=_not_json)  # printed refused or not
        if verified[0] != 0:
            assert_one_line_error(verified[0], None, verified[2])
        assert described["verify"]["ok"] is (verified[0] == 0)
        scored = score_cmd(cli, run, w)
        refused_or(scored, lambda: None)
        assert (verified[0] == 0) == (scored[0] == 0), (verified[2], scored[2])
