"""MkDocs hooks of the docs site (mkdocs.yml ``hooks:``).

A page whose line is ``--8<-- "FILE"`` takes the text of FILE at the repository root in its place
(docs/changelog.md shows CHANGELOG.md, docs/contributing.md shows CONTRIBUTING.md), so each of
those files has one home and reads the same on the site as in the repository. Their links are
written for the repository (``docs/metrics.md``, ``CHANGELOG.md#version-policy``) and are rewritten
to the site's pages; a link to any other file of the repository is left as it is, and the strict
build then names it.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INCLUDE = re.compile(r'^--8<-- "(?P<file>[^"]+)"\s*$', re.MULTILINE)
LINK = re.compile(r"\]\((?P<target>[^)#\s]+)(?P<anchor>#[^)\s]*)?\)")
#: repository files that are pages of the site under another name
PAGES = {"CHANGELOG.md": "changelog.md", "CONTRIBUTING.md": "contributing.md"}


def included(file: str) -> str:
    """FILE's text with its repository links pointing at the site's pages."""
    text = (ROOT / file).read_text(encoding="utf-8")
    return LINK.sub(_site_link, text)


def _site_link(match: re.Match) -> str:
    target, anchor = match["target"], match["anchor"] or ""
    if target in PAGES:
        target = PAGES[target]
    elif target.startswith("docs/"):
        target = target.removeprefix("docs/")
    return f"]({target}{anchor})"


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Replace every include line of a page at the root of docs/ by the file it names."""
    if "/" in page.file.src_uri:
        return markdown  # the repository's links are relative to the root, as are these pages
    return INCLUDE.sub(lambda m: included(m["file"]), markdown)


#: a Sphinx role as the docstrings write it (``:func:`~geomscope.x.y```), once Markdown has made its
#: argument code: the role's name is dropped, and ``~`` keeps the last component, as Sphinx shows it
SPHINX_ROLE = re.compile(
    r":(?:func|class|meth|mod|data|attr|exc|obj):<code>(?P<tilde>~?)(?P<name>[^<]+)</code>"
)


def _role(match: re.Match) -> str:
    name = match["name"].rsplit(".", 1)[-1] if match["tilde"] else match["name"]
    return f"<code>{name}</code>"


def on_page_content(html: str, page, config, files) -> str:
    """The API page's docstrings use Sphinx roles; show their names as code."""
    return SPHINX_ROLE.sub(_role, html)
