"""A score report's per-layer table as HTML: what a notebook shows for a Report
(``Report._repr_html_``) and what each report's section of ``report --html``'s page holds.

Cells show value over ± its standard error (formatting.value_and_se), or the number alone; every
text from the report is escaped (:func:`escape_html`).
"""

from __future__ import annotations

import html

from geomscope.formatting import shown_name, value_and_se
from geomscope.schema import csv_metric_columns, metric_label


def escape_html(v) -> str:
    """``v`` as HTML text (None as nothing)."""
    return html.escape("" if v is None else str(v))


def number_html(v) -> str:
    """A number as a table shows it: integers with thousands separators, floats to 4 significant
    digits (in e-notation below 1e-3), None as a dash."""
    if v is None:
        return "–"
    if isinstance(v, (int,)) and not isinstance(v, bool):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.4g}" if v == 0 or abs(v) >= 1e-3 else f"{v:.2e}"
    return escape_html(v)


def _table_metrics(report: dict) -> list[str]:
    layers = report.get("layers", [])
    return [m for m in csv_metric_columns(report) if any(isinstance(e.get(m), (int, float)) for e in layers)]


def report_table_html(report: dict) -> str:
    """The per-layer table: every metric with a value in some layer, value over ± its SE, and the
    outlier dimensions (the table a notebook shows for a report)."""
    metrics = _table_metrics(report)
    layers = report.get("layers", [])
    head = "".join(f"<th>{escape_html(metric_label(m))}</th>" for m in metrics)
    with_out = any(e.get("outliers") for e in layers)
    out = ["<table class='layers'><thead><tr><th>layer</th><th>rows</th>", head]
    out.append("<th>outliers</th>" if with_out else "")
    out.append("</tr></thead><tbody>")
    for e in layers:
        se = e.get("se") or {}
        cells = []
        for m in metrics:
            value_text, se_text = value_and_se(e.get(m), se.get(m), digits=4)
            if se_text is None:
                cells.append(f"<td>{number_html(e.get(m))}</td>")
            else:
                cells.append(
                    f"<td>{escape_html(value_text)}<br><span class='se'>±{escape_html(se_text)}</span></td>"
                )
        dims = " ".join(str(d) for d in e.get("outliers") or [])
        out.append(
            f"<tr><td>{escape_html(shown_name(e.get('layer')))}</td><td>{number_html(e.get('n_rows'))}</td>{''.join(cells)}"
            + (f"<td>{escape_html(dims)}</td>" if with_out else "")
            + "</tr>"
        )
    out.append("</tbody></table>")
    return "".join(out)
