"""CLI tests of `geomscope plot`: files written, --json, and one-line errors for bad input (a damaged
trajectory.csv among them)."""

from __future__ import annotations

import json

import pytest
from conftest import assert_one_line_error
from matplotlib.figure import Figure
from test_plot_factory import make_report, pythia_reports, write_report

SMALL = {"n_layers": 4, "hidden": 32}
FAST = ["--dpi", "40"]


@pytest.fixture
def reports(tmp_path):
    a = write_report(tmp_path / "a.json", make_report(**SMALL))
    b = write_report(tmp_path / "b.json", make_report(name="bert", revision="v2", seed=3, **SMALL))
    return a, b


def test_plot_one_file(cli, reports, tmp_path):
    out = tmp_path / "fig.png"
    code, stdout, err = cli(["plot", *reports, "--out", out, *FAST])
    assert code == 0, err
    assert out.read_bytes().startswith(b"\x89PNG")
    assert stdout == "" and f"wrote layers: {out}" in err


def test_plot_directory_json_and_format(cli, reports, tmp_path):
    outdir = tmp_path / "figs"
    code, stdout, err = cli(["plot", *reports, "--out", f"{outdir}/", "--format", "svg", "--json", *FAST])
    assert code == 0, err
    res = json.loads(stdout)
    assert res["kinds"] == ["layers", "spectrum", "outliers"]
    assert res["figures"] == [str(outdir / f"{k}.svg") for k in res["kinds"]]
    for p in res["figures"]:
        with open(p, "rb") as fh:
            assert fh.read(5) == b"<?xml"


@pytest.mark.parametrize("ext, magic", [("pdf", b"%PDF"), ("svg", b"<?xml")])
def test_plot_extension_picks_format(cli, reports, tmp_path, ext, magic):
    out = tmp_path / "sub" / f"spec.{ext}"
    code, _, err = cli(["plot", reports[0], "--out", out, "--kind", "spectrum", "--normalise", "-q", *FAST])
    assert code == 0, err
    assert out.read_bytes().startswith(magic) and err == ""


def test_plot_kinds_metrics_and_trajectory(cli, tmp_path):
    paths = [write_report(tmp_path / f"s{i}.json", r) for i, r in enumerate(pythia_reports(**SMALL))]
    outdir = tmp_path / "out"
    code, stdout, err = cli(
        [
            "plot",
            *paths,
            "--out",
            f"{outdir}/",
            "-k",
            "trajectory,layers",
            "--log-x",
            "--metrics",
            "isoscore,avgcos_centred",
            "--layers",
            "0,layer_03",
            "--json",
            *FAST,
        ]
    )
    assert code == 0, err
    assert json.loads(stdout)["kinds"] == ["trajectory", "layers"]
    assert (outdir / "trajectory.png").stat().st_size > 0 and (outdir / "layers.png").stat().st_size > 0
    # auto with one file and a trajectory's worth of checkpoints draws the trajectory
    code, stdout, err = cli(["plot", *paths, "--out", tmp_path / "t.png", "--json", *FAST])
    assert code == 0 and json.loads(stdout)["kinds"] == ["trajectory"]


def _bad(tmp_path):
    (tmp_path / "corrupt.json").write_text('{"format": "geomscope-report", "layers": [')
    (tmp_path / "other.json").write_text(json.dumps({"format": "something", "rows": 3}))
    write_report(tmp_path / "good.json", make_report(**SMALL))
    write_report(tmp_path / "main.json", make_report(revision="main", **SMALL))
    write_report(tmp_path / "s0.json", make_report(revision="step0", **SMALL))
    write_report(tmp_path / "blk.json", make_report(layer_prefix="blk", seed=2, **SMALL))
    write_report(tmp_path / "nospec.json", make_report(spectrum=False, **SMALL))


@pytest.mark.parametrize(
    "args, needles",
    [
        (["missing.json"], ["not found", "missing.json"]),
        (["other.json"], ["not a geomscope report"]),
        (["corrupt.json"], ["not valid JSON"]),
        (
            ["good.json", "--metrics", "isoscore,bogus"],
            ["unknown metric 'bogus'", "available:", "isoscore_star"],
        ),
        (["s0.json", "main.json", "--kind", "trajectory"], ["no training step", "main.json"]),
        (["good.json", "blk.json"], ["share no layer"]),
        (["nospec.json", "--kind", "spectrum"], ["no eigenvalues"]),
        (["good.json", "--kind", "layers", "--kind", "spectrum"], ["one figure kind"]),
        (["good.json", "--kind", "bars"], ["unknown figure kind 'bars'"]),
        (["good.json", "--format", "svg"], ["contradicts"]),
        (["good.json", "--layers", "layer_77"], ["layer 'layer_77'"]),
    ],
)
def test_plot_bad_input(cli, tmp_path, args, needles):
    _bad(tmp_path)
    target = tmp_path / "existing.png"
    target.write_bytes(b"old figure")
    before = sorted(p.name for p in tmp_path.iterdir())
    args = [str(tmp_path / a) if a.endswith(".json") else a for a in args]
    code, out, err = cli(["plot", *args, "--out", target])
    assert_one_line_error(code, out, err, *needles)
    assert target.read_bytes() == b"old figure"  # nothing already written is lost
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing half-written


def test_plot_output_folder_blocked_by_a_file(cli, reports, tmp_path):
    (tmp_path / "taken").write_text("a file")
    code, out, err = cli(["plot", *reports, "--out", f"{tmp_path}/taken/"])
    assert_one_line_error(code, out, err, "cannot create the output folder")
    code, out, err = cli(["plot", *reports, "--out", tmp_path / "taken" / "f.png"])
    assert_one_line_error(code, out, err, "cannot create the output folder")
    assert (tmp_path / "taken").read_text() == "a file"


@pytest.mark.parametrize("out", ["fig.jpg", "fig"])
def test_plot_unsupported_extension(cli, reports, tmp_path, out):
    code, stdout, err = cli(["plot", *reports, "--out", tmp_path / out])
    assert_one_line_error(code, stdout, err, "unsupported extension", ".png, .svg or .pdf")
    assert not (tmp_path / out).exists()


def _fake_training_plotter(monkeypatch, calls):
    """Replace the training-log plotter's two entry points, recording what plot hands it."""
    import geomscope.plot.training as mod

    def is_training_log(path):
        from pathlib import Path

        p = Path(path)
        return p.name == "steps.jsonl" or (p / "steps.jsonl").is_file()

    def plot_training_log(log_paths, out):
        calls.append((list(log_paths), str(out)))
        fig = Figure()
        fig.add_subplot().plot([0, 1], [2.0, 1.0], label="loss")
        return fig

    monkeypatch.setattr(mod, "is_training_log", is_training_log)
    monkeypatch.setattr(mod, "plot_training_log", plot_training_log)


def test_training_logs_are_delegated(cli, tmp_path, monkeypatch, reports):
    run = tmp_path / "ft"
    run.mkdir()
    (run / "steps.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    calls = []
    _fake_training_plotter(monkeypatch, calls)
    code, stdout, err = cli(["plot", run, "--out", f"{tmp_path}/figs/", "--json", *FAST])
    assert code == 0, err
    assert json.loads(stdout) == {"figures": [str(tmp_path / "figs" / "training.png")], "kinds": ["training"]}
    assert calls == [([str(run)], "None")]  # the figure comes back; plot writes it atomically
    assert (tmp_path / "figs" / "training.png").read_bytes().startswith(b"\x89PNG")
    # mixing a training log with a score report, or asking a report kind of a log, is refused
    code, out, err = cli(["plot", run, reports[0], "--out", tmp_path / "x.png"])
    assert_one_line_error(code, out, err, "cannot mix training logs and score reports")
    code, out, err = cli(["plot", run / "steps.jsonl", "--kind", "spectrum", "--out", tmp_path / "x.png"])
    assert_one_line_error(code, out, err, "--kind spectrum needs score reports")
    assert not (tmp_path / "x.png").exists()


def test_training_log_with_the_real_plotter(cli, tmp_path):
    run = tmp_path / "istar"
    run.mkdir()
    (run / "steps.jsonl").write_text(
        "".join(
            json.dumps({"step": s, "epoch": 0, "task_loss": 1.0 / s, "penalty": 0.5, "isoscore_star": 0.4})
            + "\n"
            for s in range(1, 6)
        )
    )
    code, stdout, err = cli(["plot", run / "steps.jsonl", "--out", tmp_path / "train.svg", "--json", *FAST])
    assert code == 0, err
    assert json.loads(stdout)["kinds"] == ["training"]
    assert (tmp_path / "train.svg").read_bytes().startswith(b"<?xml")


@pytest.mark.parametrize(
    "damage, needle",
    [
        ("steps_list", "not a finetune record"),
        ("steps_text_step", "no integer step"),
        ("steps_text_loss", "task_loss is not a number"),
        ("eval_text", "not a finetune record"),
        ("energy_key", "keyed by rank"),
        ("bytes", "not UTF-8"),
        ("deep", "not valid JSON"),
    ],
)
def test_a_damaged_training_log_is_one_line(cli, tmp_path, damage, needle):
    """A finetune output whose logs were damaged or hand-made: one line naming the file, not a traceback
    from inside the plot."""
    run = tmp_path / "istar"
    run.mkdir()
    good = {"step": 1, "epoch": 0, "task_loss": 1.0, "penalty": 0.5, "isoscore_star": 0.4}
    lines = [json.dumps({**good, "step": s}) for s in range(1, 4)]
    evals = [json.dumps({"step": 3, "accuracy": 0.5, "isoscore_star": 0.3})]
    (run / "run.json").write_text(json.dumps({"config": {"reg": "istar", "lam": "x"}}))  # the legend only
    if damage == "steps_list":
        lines.append("[1, 2]")
    elif damage == "steps_text_step":
        lines.append(json.dumps({**good, "step": "abc"}))
    elif damage == "steps_text_loss":
        lines.append(json.dumps({**good, "step": 9, "task_loss": "high"}))
    elif damage == "eval_text":
        evals.append('"x"')
    elif damage == "energy_key":
        lines.append(json.dumps({**good, "step": 9, "geometry": {"layer_1": {"energy": {"abc": 0.1}}}}))
    elif damage == "deep":
        lines.append("[" * 100_000 + "]" * 100_000)
    (run / "steps.jsonl").write_text("\n".join(lines) + "\n")
    (run / "eval.jsonl").write_text("\n".join(evals) + "\n")
    if damage == "bytes":
        (run / "steps.jsonl").write_bytes(b'{"step": 1}\n\xff\xfe\n')
    code, out, err = cli(["plot", run, "--out", tmp_path / "train.png", *FAST])
    assert_one_line_error(code, out, err, needle, exit_code=2)
    assert not (tmp_path / "train.png").exists()


def test_every_figure_is_closed_when_a_write_fails_midway(tmp_path, monkeypatch):
    """plot_files draws all kinds first: a write that fails (a full disk) leaves none of the rest open."""
    from test_plot_factory import make_report, write_report

    import geomscope.plot.figures as figures
    from geomscope.errors import InputError

    rep = write_report(tmp_path / "r.json", make_report(n_layers=4, hidden=24))
    closed, writes = [], []
    real_close = figures.close_figure
    monkeypatch.setattr(figures, "close_figure", lambda fig: (closed.append(id(fig)), real_close(fig)))

    def full_disk(path, data):
        writes.append(path)
        if len(writes) == 2:
            raise OSError(28, "No space left on device")
        path.write_bytes(data)

    monkeypatch.setattr(figures, "write_bytes_atomic", full_disk)
    with pytest.raises(InputError, match="No space left"):
        figures.plot_files([rep], f"{tmp_path}/figs/")
    drawn = len(figures.make_figures([figures.read_report(rep)], ["auto"]))
    assert drawn >= 3 and len(set(closed)) >= drawn  # each figure of the failed call closed once


@pytest.mark.parametrize(
    "edit",
    [
        lambda row: row.update(step="abc"),
        lambda row: row.update(isoscore="high"),
        lambda row: row.update(n_rows="inf"),
        lambda row: row.update(n_rows="2.5"),
        "extra_cell",
    ],
)
def test_a_damaged_trajectory_is_one_line_for_plot(cli, tmp_path, edit):
    import csv

    from geomscope.score.trajectory import to_trajectory_csv

    reps = []
    for step in (0, 1000):
        rep = make_report(n_layers=3, hidden=16)
        rep["model"]["revision"] = f"step{step}"
        reps.append(rep)
    path = tmp_path / "trajectory.csv"
    path.write_text(to_trajectory_csv(reps))
    assert cli(["plot", path, "--out", f"{tmp_path}/ok/", "--quiet"])[0] == 0
    rows = list(csv.DictReader(path.open()))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for i, row in enumerate(rows):
            if i == 2 and edit != "extra_cell":
                edit(row)
            w.writerow(row)
    if edit == "extra_cell":
        with path.open("a") as f:
            f.write(",".join(["x"] * (len(rows[0]) + 3)) + "\n")
    code, out, err = cli(["plot", path, "--out", f"{tmp_path}/figs/", "--quiet"])
    assert_one_line_error(code, out, err, "trajectory.csv line", exit_code=2)
