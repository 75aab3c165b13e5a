"""Hostile run directories: a manifest or a shard mutated once (``--keep all`` and ``--keep
sample`` runs), read by ``score`` and ``inspect --verify``. The contract and the clean runs:
helpers_fuzz.py."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import assert_one_line_error
from helpers_fuzz import (
    FUZZ,
    JSON_OPS,
    SCALE,
    draw_json_mutation,
    layer_numbers,
    refused_or,
    run_cmd,
    same_numbers,
    shown,
    workdir,
)

# a derandomised Hypothesis test draws its examples from a digest of its source: the tests below
# use this name, and another name would draw other examples
from helpers_fuzz import not_json as _not_json
from hypothesis import given, note, settings
from hypothesis import strategies as st

from geomscope.store import checksum


@pytest.fixture(scope="module")
def runs(fuzz_runs):
    """The clean runs and their numbers (helpers_fuzz.clean_runs, built once a session)."""
    return fuzz_runs


# ------------------------------------------------------------------------------ score of a run
def score_cmd(cli, run: Path, w: Path) -> tuple[int, str, str]:
    return run_cmd(cli, ["score", run, "--out", w / "rep", "--quiet"])


def scored(w: Path) -> dict:
    """The numbers of the report ``score_cmd`` wrote (strict JSON: non-finite numbers are null)."""
    return layer_numbers(json.loads((w / "rep.json").read_text(), parse_constant=_not_json))


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
