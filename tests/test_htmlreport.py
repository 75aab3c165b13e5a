"""The one-page HTML report (``geomscope report --html``), checked by parsing and, when headless
Chromium is installed, in a real browser."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest
from test_plot_factory import make_report, pythia_reports, write_report

SMALL = {"n_layers": 4, "hidden": 24}


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.imgs, self.rows, self.text = [], [], 0, []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        if tag == "img":
            self.imgs.append(a)
        if tag == "tr":
            self.rows += 1

    def handle_data(self, data):
        self.text.append(data)


def _external(attrs: dict) -> list[str]:
    return [
        v
        for k, v in attrs.items()
        if k in ("src", "href", "srcset", "data") and v and not v.startswith("data:")
    ]


def test_html_page_is_self_contained_with_table_figures_and_provenance(tmp_path, cli):
    reps = [
        make_report(**SMALL, null_twonn_layer=1),
        make_report(**SMALL, seed=3, name="other/model", revision="main"),
    ]
    reps[0]["command"] = "geomscope score run --out r"
    paths = [write_report(tmp_path / f"r{i}.json", r) for i, r in enumerate(reps)]
    code, out, err = cli(["report", *paths, "--html", tmp_path / "page.html", "--json", "-q"])
    assert code == 0, err
    assert json.loads(out) == {"html": str(tmp_path / "page.html"), "reports": 2}
    html = (tmp_path / "page.html").read_text(encoding="utf-8")
    page = _Page()
    page.feed(html)
    assert not any(_external(a) for _, a in page.tags), "the page must not fetch anything"
    assert not any(t == "script" for t, _ in page.tags) and not any(t == "link" for t, _ in page.tags)
    assert [i["alt"] for i in page.imgs] == ["layers figure", "spectrum figure", "outliers figure"]
    for img in page.imgs:
        head, data = img["src"].split(",", 1)
        assert head == "data:image/svg+xml;base64"
        root = ET.fromstring(base64.b64decode(data))  # a whole, parseable SVG
        assert root.tag.endswith("svg") and len(list(root.iter())) > 50
    text = " ".join(page.text)
    assert "geomscope score run --out r" in text and "other/model@main" in text
    assert reps[0]["layers"][1]["notes"]["twonn"] in text  # the reason a metric is null
    assert page.rows >= 2 * (1 + SMALL["n_layers"])


def test_html_report_of_a_trajectory_and_bad_input(tmp_path, cli):
    from conftest import assert_one_line_error

    paths = [
        write_report(tmp_path / f"s{i}.json", r)
        for i, r in enumerate(pythia_reports(steps=(0, 1000, 7000), **SMALL))
    ]
    code, out, err = cli(["report", *paths, "--html", tmp_path / "t.html", "-k", "trajectory", "-q"])
    assert code == 0, err
    assert "fig-trajectory" in (tmp_path / "t.html").read_text()
    (tmp_path / "bad.json").write_text("{}")
    code, out, err = cli(["report", tmp_path / "bad.json", "--html", tmp_path / "b.html"])
    assert_one_line_error(code, out, err, "not a geomscope report", exit_code=2)
    assert not (tmp_path / "b.html").exists()


def _chromium() -> str | None:
    for name in (
        "chromium",
        "chromium-browser",
        "google-chrome",
        "google-chrome-stable",
        "chrome",
        "headless_shell",
    ):
        if shutil.which(name):
            return shutil.which(name)
    return None


@pytest.mark.skipif(_chromium() is None, reason="headless Chromium is not installed on this machine")
def test_html_page_renders_in_headless_chromium(tmp_path):
    """The page, loaded by a real browser: every figure decodes to an image with a size, the tables
    are there, and the console shows no error. A copy of the page gets a probe script (the page
    itself has none) that writes what the browser saw into the DOM that --dump-dom prints."""
    from geomscope.htmlreport import write_html

    page = write_html([make_report(**SMALL)], tmp_path / "page.html")
    probe = (
        "<script>window.addEventListener('load',()=>{const imgs=[...document.images];"
        "document.body.setAttribute('data-probe',JSON.stringify({imgs:imgs.length,"
        "decoded:imgs.filter(i=>i.complete&&i.naturalWidth>0).length,"
        "tables:document.querySelectorAll('table.layers tr').length}));});</script>"
    )
    probed = tmp_path / "probed.html"
    probed.write_text(
        page.read_text(encoding="utf-8").replace("</body>", probe + "</body>"), encoding="utf-8"
    )
    res = subprocess.run(
        [
            _chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=5000",
            "--dump-dom",
            probed.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    import re

    m = re.search(r"data-probe=\"([^\"]+)\"", res.stdout)
    assert m, res.stdout[-2000:]
    seen = json.loads(m.group(1).replace("&quot;", '"'))
    assert seen["imgs"] == 3 and seen["decoded"] == 3, seen
    assert seen["tables"] == 1 + SMALL["n_layers"], seen
    console = [ln for ln in res.stderr.splitlines() if "CONSOLE" in ln and ("rror" in ln or "Uncaught" in ln)]
    assert not console, console
