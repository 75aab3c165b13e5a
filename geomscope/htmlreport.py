"""One self-contained HTML page for score reports (``geomscope report REPORT... --html FILE``).

The page needs nothing at view time: styles are inline, figures are SVG embedded as ``data:`` URIs
(an ``<img>`` each, so the ids inside one figure's SVG cannot clash with another's), and there is no
script. It holds, per report: provenance (model, revision, commit, source, rows, geomscope version,
date, command line), parameters, the per-layer table of every metric with a value (value ± standard
error) and the notes that say why a metric is null; then every figure ``plot`` draws for the reports
together (layers, spectrum, outliers, trajectory -- those the reports support).
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from geomscope.choices import PLOT_KINDS
from geomscope.formatting import shown_name
from geomscope.htmltable import escape_html as _e  # short: it wraps every value of the page
from geomscope.htmltable import number_html as _num
from geomscope.htmltable import report_table_html
from geomscope.options import Text, check, option
from geomscope.plot.options import KIND_LIST
from geomscope.schema import HTML_GENERATOR


@dataclass(frozen=True)
class ReportOptions:
    """What the page shows besides the reports, declared once (:mod:`geomscope.options`):
    ``geomscope report --help`` is built from these fields, and :func:`write_html` takes the same
    object. ``kinds``: the figure kinds, as ``plot`` names them (one comma string or a list of them;
    an empty list is ``auto``); ``title`` None: one made from the reports."""

    kinds: tuple[str, ...] | list | str = option(
        ("auto",),
        KIND_LIST,
        f"Figures: {'|'.join(k for k in PLOT_KINDS if k != 'training')} "
        "(comma list; auto: every kind the reports support).",
        metavar="LIST",
        flag="--kind",
        short="-k",
    )
    title: str | None = option(None, Text(), "Page title.", metavar="TEXT", optional=True)

    def validate(self) -> ReportOptions:
        """A checked copy with ``kinds`` as a list of names; OptionError (one line) naming the
        option otherwise."""
        check(self)
        return replace(self, kinds=KIND_LIST.items(self.kinds) or ["auto"])


#: how every page begins, byte for byte, up to the generator mark (a page without the mark, which
#: :func:`_is_page` also accepts, goes straight on to the viewport)
_OPENING = "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
_VIEWPORT = "<meta name='viewport' content='width=device-width, initial-scale=1'>"
#: the opening of each report's section
_SECTION = "<section class='report'><h2>"

_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:2rem auto;max-width:70rem;
color:#222;line-height:1.4;padding:0 1rem}
h1{font-size:1.5rem}h2{font-size:1.2rem;margin-top:2rem;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.85rem;margin:.5rem 0}
th,td{padding:.2rem .6rem;border-bottom:1px solid #eee;text-align:right;vertical-align:top}
th:first-child,td:first-child{text-align:left}
table.kv td,table.kv th{text-align:left}
.se{color:#777;font-size:.75rem}
code{font-size:.8rem;word-break:break-all}
figure{margin:1.5rem 0}figure img{max-width:100%;height:auto;border:1px solid #eee}
figcaption{font-size:.85rem;color:#555}
.notes li{font-size:.85rem}
""".strip()


def _title(report: dict) -> str:
    model = report.get("model") or {}
    src = report.get("source") or {}
    name = shown_name(model.get("name") or Path(str(src.get("path") or "report")).name)
    return name + (f"@{shown_name(model['revision'])}" if model.get("revision") else "")


def _name(v):
    """A name of the page's provenance as shown (:func:`geomscope.formatting.shown_name`); None as is."""
    return None if v is None else shown_name(v)


def _provenance(report: dict) -> str:
    model = report.get("model") or {}
    src = report.get("source") or {}
    run = report.get("run") or {}
    rows = [
        ("model", _name(model.get("name"))),
        ("revision", _name(model.get("revision"))),
        ("commit", _name(model.get("commit"))),
        (
            "source",
            f"{src.get('kind')}"
            + (f" ({src['format']})" if src.get("format") else "")
            + f": {shown_name(src.get('path'))}",
        ),
        ("data", _name(src.get("dataset"))),
        (
            "rows / documents",
            f"{run.get('rows')} / {run.get('docs')}" if run.get("rows") is not None else None,
        ),
        ("partition isotropy I(W)", _embeddings(report.get("embeddings"))),
        ("geomscope", report.get("geomscope_version")),
        ("created", report.get("created")),
        ("command", report.get("command")),
        ("report file", _name(report.get("_path"))),
    ]
    code = ("command", "commit")
    body = "".join(
        f"<tr><th>{_e(k)}</th><td>{f'<code>{_e(v)}</code>' if k in code else _e(v)}</td></tr>"
        for k, v in rows
        if v not in (None, "")
    )
    return f"<table class='kv'>{body}</table>"


def _embeddings(emb) -> str | None:
    if not isinstance(emb, dict) or not isinstance(emb.get("input"), dict):
        return None
    text = f"input: raw {_num(emb['input'].get('raw'))}, centred {_num(emb['input'].get('centred'))}"
    if emb.get("tied"):
        return text + " (output tied)"
    if isinstance(emb.get("output"), dict):
        text += (
            f"; output: raw {_num(emb['output'].get('raw'))}, centred {_num(emb['output'].get('centred'))}"
        )
    return text


def _params(report: dict) -> str:
    params = report.get("params") or {}
    body = "".join(
        f"<tr><th>{_e(k)}</th><td>{_e(v if not isinstance(v, (list, dict)) else _compact(v))}</td></tr>"
        for k, v in params.items()
    )
    return f"<details><summary>parameters</summary><table class='kv'>{body}</table></details>"


def _compact(v) -> str:
    import json

    return json.dumps(v, separators=(", ", ": "))


def _final_norm(report: dict) -> str:
    from geomscope.report import final_norm_line

    fn = report.get("final_norm")
    return f"<p class='final-norm'>{_e(final_norm_line(fn))}</p>" if fn else ""


def _norms(report: dict) -> str:
    from geomscope.report import norm_line, norms_line
    from geomscope.schema import NORMS_KEY

    norms = report.get(NORMS_KEY)
    if not norms:
        return ""
    items = "".join(f"<li>{_e(norm_line(n))}</li>" for n in norms)
    return f"<details class='norms'><summary>{_e(norms_line(norms))}</summary><ul>{items}</ul></details>"


def _fmt(v) -> str:
    return "–" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))


#: the diagnostics' per-layer lists, as the page shows them: (key, column heading, one cell's text)
_DIAGNOSTIC_CELLS = (
    (
        "rogue_dims",
        "rogue dimensions (share of the cosine)",
        lambda v: ", ".join(f"{d['dim']}: {_fmt(d.get('share'))}" for d in v[:3]),
    ),
    (
        "massive",
        "largest |x| (dimension, token id, position); median |x|",
        lambda v: (
            "; ".join(
                f"{_fmt(e.get('value'))} (d{e.get('dim')}, t{e.get('token_id')}, p{e.get('position')})"
                for e in v["entries"][:2]
            )
            + f"; median {_fmt(v.get('median_abs'))}; {v.get('first_token')} of {len(v['entries'])} on "
            f"a first token, {v.get('special')} special"
        ),
    ),
    (
        "contextuality",
        "contextuality: types, sentences, baselines (cos, MEV)",
        lambda v: (
            f"{v.get('types')}, {v.get('sentences')}, {_fmt(v.get('baseline_cos'))}, "
            f"{_fmt(v.get('baseline_mev'))}"
        ),
    ),
    (
        "local",
        "local isotropy: k (cluster sizes)",
        lambda v: f"{v.get('k')} ({', '.join(str(c.get('n')) for c in v.get('clusters') or [])})",
    ),
)


def _diagnostics(report: dict) -> str:
    """The diagnostics' per-layer lists (rogue dimensions, massive activations, contextuality's
    samples, local clusters) in one table, where the report holds any."""
    layers = report.get("layers", [])
    cells = [c for c in _DIAGNOSTIC_CELLS if any(isinstance(e.get(c[0]), (dict, list)) for e in layers)]
    if not cells:
        return ""
    head = "".join(f"<th>{_e(title)}</th>" for _, title, _ in cells)
    rows = []
    for e in layers:
        tds = []
        for key, _, text in cells:
            v = e.get(key)
            try:
                tds.append(f"<td>{_e(text(v)) if v else '–'}</td>")
            except (KeyError, TypeError, AttributeError, IndexError):  # a hand-edited entry
                tds.append("<td>–</td>")
        rows.append(f"<tr><td>{_e(shown_name(e.get('layer')))}</td>{''.join(tds)}</tr>")
    return (
        "<h3>Diagnostics by layer</h3><table class='kv'><thead><tr><th>layer</th>"
        f"{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )


def _notes(report: dict) -> str:
    items = []
    for k, why in (report.get("notes") or {}).items():
        items.append(f"<li><b>{_e(k)}</b>: {_e(why)}</li>")
    for e in report.get("layers", []):
        for k, why in (e.get("notes") or {}).items():
            items.append(f"<li><b>{_e(e.get('layer'))} {_e(k)}</b>: {_e(why)}</li>")
    if not items:
        return ""
    return f"<h3>Notes on null metrics</h3><ul class='notes'>{''.join(items)}</ul>"


def _svg_uri(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    return "data:image/svg+xml;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


_FIGURE_CAPTIONS = {
    "layers": "Each metric against layer index (error bars: ±1 standard error).",
    "spectrum": "Covariance eigenspectra by layer.",
    "outliers": "Outlier dimensions by layer (dots: flagged dimensions).",
    "trajectory": "Each metric against training step, one line per layer.",
    "diagnostics": (
        "The anisotropy diagnostics against layer, one panel per family the reports hold (error bars: "
        "±1 standard error)."
    ),
    "similarity": (
        "Linear CKA and RSA (Spearman) between every pair of layers, on the seeded sample (the same rows "
        "in every layer)."
    ),
    "energy": (
        "Gradient energy captured by the top-r activation subspace against rank, per gradient layer "
        "(band: random normal controls; dashed: the isotropic r/D), and kappa by layer."
    ),
}


def html_page(reports: Sequence[dict], *, kinds: Sequence[str] = ("auto",), title: str | None = None) -> str:
    """The page for loaded reports (see the module docstring)."""
    from geomscope.plot.figures import close_figure, make_figures

    figs = make_figures(reports, kinds)
    figures = []
    for kind, fig in figs.items():
        uri = _svg_uri(fig)
        close_figure(fig)
        figures.append(
            f"<figure id='fig-{_e(kind)}'><img src='{uri}' alt='{_e(kind)} figure'>"
            f"<figcaption>{_e(_FIGURE_CAPTIONS.get(kind, kind))}</figcaption></figure>"
        )
    title = title or (
        "geomscope: " + ", ".join(_title(r) for r in reports[:3]) + (" …" if len(reports) > 3 else "")
    )
    sections = []
    for r in reports:
        sections.append(
            f"{_SECTION}{_e(_title(r))}</h2>{_provenance(r)}{_params(r)}"
            f"{report_table_html(r)}{_final_norm(r)}{_norms(r)}{_diagnostics(r)}{_notes(r)}</section>"
        )
    return (
        f"{_OPENING}{HTML_GENERATOR}{_VIEWPORT}"
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>"
        f"<h1>{_e(title)}</h1>{''.join(sections)}<h2>Figures</h2>{''.join(figures)}</body></html>\n"
    )


def _is_page(data: bytes) -> bool:
    """A page geomscope wrote: one that begins exactly as :func:`html_page` begins it, with the
    generator mark; or one that begins with that opening without the mark and holds the report
    sections. A mark or a section anywhere else (a user's notes quoting a page) is not enough."""
    if data.startswith((_OPENING + HTML_GENERATOR).encode()):
        return True
    return data.startswith((_OPENING + _VIEWPORT + "<title>").encode()) and _SECTION.encode() in data


def write_html(
    reports: Sequence[dict], path: str | os.PathLike, options: ReportOptions | None = None, **overrides
) -> Path:
    """Write :func:`html_page` to ``path`` atomically (a crash never leaves half a page). A file
    already there is replaced only if it is a page geomscope wrote. ``options``: a
    :class:`ReportOptions`; keyword ``overrides`` replace its fields (``write_html(r, p, title="t")``)."""
    from geomscope.fileio import make_dirs, write_text_atomic
    from geomscope.outputs import ensure_replaceable

    opts = replace(options or ReportOptions(), **overrides).validate()
    path = Path(path)
    ensure_replaceable(path, _is_page, option="--html")
    page = html_page(reports, kinds=opts.kinds, title=opts.title)
    make_dirs(path.parent, option="--html")
    write_text_atomic(path, page)
    return path
