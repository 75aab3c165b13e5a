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


@pytest.mark.parametrize("rel", FRONT_PAGES[:1] + H_PAGES)
def test_no_dates_in_the_front_page_and_explanations(rel):
    assert not DATE.search(_text(rel)), f"{rel} carries a date; history goes to commit messages"


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
        elif item.suffix == ".py":
            assert item.name in layout, f"the layout does not name geomscope/{item.name}"


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
