"""The README, CHANGELOG, CONTRIBUTING and the reference and explanation pages say what the
repository holds: their links resolve, the files, targets, keys and names they cite exist, and the
README stays a front page."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

import geomscope
from geomscope.schema import LAYER_KEYS, REPORT_FORMAT, REPORT_KEYS, SCALAR_METRIC_NAMES
from geomscope.store.names import FORMAT_VERSION, MANIFEST_NAME, RUN_FORMAT, SHARD_FORMAT

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FRONT_PAGES = ("README.md", "CHANGELOG.md", "CONTRIBUTING.md")
H_PAGES = (
    "docs/reference/report-format.md",
    "docs/reference/run-format.md",
    "docs/explanation/design.md",
    "docs/explanation/reliability.md",
    "docs/explanation/performance.md",
)
#: [text](target) outside code spans; the target without its title
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
#: words of a diary, not of a description: lease logs, what an earlier build did
HISTORY = re.compile(r"\b(leases?|previously|formerly|earlier build|used to be)\b", re.I)
#: every page of the site but the generated reference and the root files it includes
DOC_PAGES = tuple(
    str(p.relative_to(ROOT))
    for p in sorted((ROOT / "docs").rglob("*.md"))
    if p.name not in ("cli.md", "changelog.md", "contributing.md")
)
TUTORIALS = tuple(p for p in DOC_PAGES if p.startswith("docs/tutorials/"))
#: what the issue asks each tutorial's full-scale version to state, and the words that state it
FULL_SCALE_NEEDS = {
    "which checkpoints": ("checkpoint",),
    "how many tokens": ("token",),
    "what hardware": ("gpu", "h200", "cpu core"),
    "how long": ("minute", "hour"),
}
WORKFLOWS = (
    "score-a-model",
    "fine-tune-with-i-star-and-compare",
    "a-checkpoint-trajectory",
    "gradient-geometry",
    "corpus-scale",
    "many-gpus-and-a-dask-cluster",
)


def _text(rel: str) -> str:
    return (ROOT / rel).read_text(encoding="utf-8")


def _without_fences(text: str) -> str:
    """The Markdown with its fenced blocks blanked out (a `#` line there is no heading)."""
    return re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.S | re.M)


def _without_code(text: str) -> str:
    """The Markdown with fenced blocks and code spans blanked out (their brackets are not links)."""
    return re.sub(r"`[^`\n]*`", "``", _without_fences(text))


def _links(rel: str) -> list[str]:
    found = LINK.findall(_without_code(_text(rel)))
    return [a or b for a, b in found]


def _slug(heading: str, *, site: bool) -> str:
    """A heading's anchor: Python-Markdown's for a page of the site (ASCII, runs of spaces and
    hyphens to one hyphen), GitHub's for the root pages (each space a hyphen)."""
    text = re.sub(r"[`*]", "", heading).strip()
    if site:
        text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
        text = re.sub(r"[^\w\s-]", "", text).strip().lower()
        return re.sub(r"[-\s]+", "-", text)
    text = re.sub(r"[^\w\s-]", "", text.lower())
    return re.sub(r"\s", "-", text)


def _anchors(rel: str) -> set[str]:
    headings = re.findall(r"^#{1,6} (.+)$", _without_fences(_text(rel)), flags=re.M)
    return {_slug(h, site=rel.startswith("docs/")) for h in headings}


def test_readme_is_a_front_page():
    lines = _text("README.md").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; the front page keeps to 300"
    assert "## Contents" in lines


@pytest.mark.parametrize("rel", FRONT_PAGES + H_PAGES)
def test_relative_links_resolve(rel):
    page = ROOT / rel
    for target in _links(rel):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{rel} links to {target}, which is not in the repository"
        if anchor and dest.suffix == ".md" and dest.is_relative_to(ROOT):
            assert anchor in _anchors(str(dest.relative_to(ROOT))), f"{rel}: no heading for #{anchor}"


def test_readme_contents_reach_every_workflow_and_docs_page():
    text = _text("README.md")
    contents = text.split("## Contents", 1)[1].split("\n## ", 1)[0]
    for anchor in WORKFLOWS:
        assert f"](#{anchor})" in contents, f"the README's contents do not link #{anchor}"
        assert anchor in _anchors("README.md")
    nav = re.findall(r":\s*([\w/-]+\.md)\s*$", _text("mkdocs.yml"), flags=re.M)
    assert nav, "mkdocs.yml lists no pages"
    for page in nav:
        if page in ("changelog.md", "contributing.md"):
            page = page.upper().replace(".MD", ".md")  # the site's copies of the root files
            assert f"]({page})" in contents, f"the README's contents do not link {page}"
            continue
        assert f"](docs/{page})" in contents, f"the README's contents do not link docs/{page}"


def test_readme_names_the_commands_ci_and_the_makefile_run():
    text = _text("README.md")
    assert "make test" in text and "make test" in _text(".ci/run")
    targets = set(re.findall(r"^([a-z][\w-]*):", _text("Makefile"), flags=re.M))
    for target in re.findall(r"\| `make ([a-z-]+)` \|", text):
        assert target in targets, f"README's table times `make {target}`, which the Makefile lacks"


@pytest.mark.parametrize("rel", FRONT_PAGES[:1] + DOC_PAGES)
def test_no_dates_or_history_in_the_readme_and_docs(rel):
    text = _text(rel)
    assert not DATE.search(text), f"{rel} carries a date; history goes to commit messages"
    found = HISTORY.search(text)
    assert not found, f"{rel} says '{found and found[0]}'; the docs say what is, history goes to commits"


@pytest.mark.parametrize("rel", TUTORIALS)
def test_each_tutorial_states_what_the_full_scale_version_needs(rel):
    text = _text(rel)
    assert "\n## The full-scale version\n" in text, f"{rel} has no '## The full-scale version' section"
    section = text.split("\n## The full-scale version\n", 1)[1].split("\n## ", 1)[0].lower()
    for need, words in FULL_SCALE_NEEDS.items():
        assert any(w in section for w in words), f"{rel}'s full-scale version does not say {need}"


def test_performance_page_has_a_table_with_the_fraction_of_the_limit_per_machine():
    text = _text("docs/explanation/performance.md")
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    machines = [s for s in sections if s.startswith(("CPU:", "GPU:"))]
    assert any(s.startswith("CPU:") for s in machines) and any(s.startswith("GPU:") for s in machines)
    for section in machines:
        headers = re.findall(r"^\|(.*)\|\s*\n\|[-| :]+\|\s*$", section, flags=re.M)
        assert any("of bound" in h for h in headers), (
            f"performance.md's {section.splitlines()[0]!r} has no 'of bound' column"
        )
    assert any(s.startswith("Method\n") for s in sections), "performance.md has no '## Method' section"


@pytest.mark.parametrize("rel", ("CONTRIBUTING.md", *H_PAGES))
def test_every_test_file_named_exists(rel):
    named = set(re.findall(r"tests/(test_\w+\.py)", _text(rel)))
    missing = sorted(n for n in named if not (ROOT / "tests" / n).exists())
    assert not missing, f"{rel} names test files that do not exist: {missing}"


def test_reliability_names_a_test_for_every_guarantee():
    sections = _text("docs/explanation/reliability.md").split("\n## ")[1:]
    for section in sections:
        title = section.splitlines()[0]
        if "Guarantee" in section:
            assert "tests/test_" in section, f"the guarantee '{title}' names no test file"


def test_contributing_layout_names_every_module():
    text = _text("CONTRIBUTING.md")
    layout = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    package = ROOT / "geomscope"
    for item in sorted(package.iterdir()):
        if item.name.startswith(("_", ".")):
            continue
        if item.is_dir() and (item / "__init__.py").exists():
            assert f"geomscope/{item.name}/" in layout, f"the layout does not name geomscope/{item.name}/"
            block = _room_block(layout, item.name)
            for module in sorted(item.glob("*.py")):
                if module.name != "__init__.py":
                    assert re.search(rf"(?<![\w/]){re.escape(module.name)}", block), (
                        f"the layout's geomscope/{item.name}/ entry does not name {module.name}"
                    )
        elif item.suffix == ".py":
            assert item.name in layout, f"the layout does not name geomscope/{item.name}"


def _room_block(layout: str, room: str) -> str:
    """The layout's lines about ``geomscope/<room>/``: from its name to the next entry's."""
    start = layout.index(f"geomscope/{room}/")
    nxt = re.search(r"\n\S", layout[start:])
    return layout[start : start + nxt.start() if nxt else None]


def test_changelog_has_the_current_version_and_unreleased():
    text = _text("CHANGELOG.md")
    assert "## [Unreleased]" in text
    assert f"## [{geomscope.__version__}]" in text
    assert "## Version policy" in text


def test_report_format_page_names_every_key():
    text = _text("docs/reference/report-format.md")
    assert REPORT_FORMAT in text
    for key in (*REPORT_KEYS, *LAYER_KEYS, *SCALAR_METRIC_NAMES):
        assert f"`{key}`" in text, f"docs/reference/report-format.md does not describe `{key}`"


def test_run_format_page_names_the_format():
    text = _text("docs/reference/run-format.md")
    for name in (MANIFEST_NAME, RUN_FORMAT, SHARD_FORMAT, f'"format_version": {FORMAT_VERSION}'):
        assert name in text, f"docs/reference/run-format.md does not name {name}"
    from geomscope.store.accumulators import PARTS
    from geomscope.store.shard import META_FIELDS, ROW_FLAGS

    for name in (*PARTS, *META_FIELDS, *ROW_FLAGS):
        assert f"`{name}`" in text or f"`/{name}`" in text, f"run-format.md does not describe {name}"


def _readme_rooms() -> list[list[str]]:
    """The README's layout table, top row first: each row's rooms (`cli/`, `report.py` ...)."""
    section = _text("README.md").split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [re.findall(r"`([\w./]+)`", row.split("|")[1]) for row in rows]


def _room_of(module: str) -> str:
    """``geomscope.score.engine`` -> ``score/``; ``geomscope.report`` -> ``report.py``."""
    parts = module.split(".")
    if (ROOT / "geomscope" / parts[1]).is_dir():
        return parts[1] + "/"
    return parts[1] + ".py"


def _geomscope_imports(path) -> list[str]:
    """Every geomscope module ``path`` imports, at its top or inside a function."""
    import ast

    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "geomscope":
            out += [f"geomscope.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("geomscope."):
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("geomscope.")]
    return out


def test_readme_layout_lists_the_rooms_top_down():
    """Each room of the README's table imports only rooms in its own row or below (the last row,
    which ends in "…", also holds every top-level module not named above it)."""

    rows = _readme_rooms()
    assert len(rows) >= 8
    row_of = {room: i for i, row in enumerate(rows) for room in row}
    package = ROOT / "geomscope"
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        if rel.name == "__main__" or len(rel.parts) < 2:
            continue
        mod = ".".join(rel.parts if rel.name != "__init__" else rel.parts[:-1])
        if mod == "geomscope":
            continue
        here = row_of.get(_room_of(mod), len(rows) - 1)
        if path.parent == package and path.stem != "__init__":
            assert _room_of(mod) in row_of or here == len(rows) - 1
        for target in _geomscope_imports(path):
            there = row_of.get(_room_of(target), len(rows) - 1)
            assert there >= here, (
                f"{rel} imports {target}, a room the README's layout lists above it; "
                "fix the import or the table"
            )
    for item in sorted(package.iterdir()):
        if item.is_dir() and (item / "__init__.py").exists():
            assert f"{item.name}/" in row_of, f"the README's layout does not name {item.name}/"
