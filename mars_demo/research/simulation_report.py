"""The report of a serving simulation (simulation.py): the totals as text, and one self-contained HTML page.

The page's charts (one curve per policy) are the app's own (ui/charts.py, serving section),
handed in by the command; plotly.js is inlined once, so the page opens without a network.
Everything shown is numbers or policy names; text goes through html.escape.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

try:
    import plotly.graph_objects as go
    import plotly.io as pio
except ModuleNotFoundError:  # the JSON report needs no plotly (a GPU machine without it): no page then
    go = pio = None

from .tables import cell, text_table

TOTALS = (  # (key, header, format)
    ("policy", "policy", "{}"),
    ("done", "done", "{}"),
    ("tokens_per_second", "tok/s", "{:.1f}"),
    ("requests_per_second", "req/s", "{:.3f}"),
    ("latency_p50", "p50 s", "{:.2f}"),
    ("latency_p95", "p95 s", "{:.2f}"),
    ("latency_p99", "p99 s", "{:.2f}"),
    ("ttft_p50", "TTFT p50 s", "{:.2f}"),
    ("ttft_p95", "TTFT p95 s", "{:.2f}"),
    ("queue_max", "queue max", "{}"),
    ("tau_mean", "mean tau", "{:.3f}"),
    ("width_mean", "mean width", "{:.2f}"),
    ("tokens_per_forward", "tok/fwd", "{:.2f}"),
    ("delta_nll_base", "dNLL (base)", "{:+.4f}"),
    ("agreement", "agree", "{:.3f}"),
)


def totals_rows(summaries: list[dict]) -> list[list[str]]:
    return [[cell(s.get(key), fmt) for key, _, fmt in TOTALS] for s in summaries]


def format_totals(summaries: list[dict]) -> str:
    """A fixed-width text table, one line per policy."""
    return text_table(summaries, TOTALS, left=1)


def _html_table(rows: list[list[str]], header: list[str]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _costs_table(costs: list[dict]) -> str:
    widths = sorted({c["width"] for c in costs})
    rows = sorted({c["rows"] for c in costs})
    ms = {(c["rows"], c["width"]): c["ms"] for c in costs}
    body = [[str(r)] + [f"{ms[(r, w)]:.1f}" if (r, w) in ms else "-" for w in widths] for r in rows]
    return _html_table(body, ["rows \\ width"] + [str(w) for w in widths])


def to_html(report: dict, figures: list[go.Figure]) -> str:
    """One self-contained page: command, machine, totals, the charts, pass costs, settings."""
    charts = "".join(
        pio.to_html(fig, full_html=False, include_plotlyjs=(i == 0), default_height="320px")
        for i, fig in enumerate(figures)
    )
    totals = _html_table(totals_rows([p["summary"] for p in report["policies"]]), [h for _, h, _ in TOTALS])
    machine = _html_table([[k, str(v)] for k, v in report.get("machine", {}).items()], ["", ""])
    costs = f"<h2>Cost per pass (ms)</h2>{_costs_table(report['pass_costs'])}" if report.get("pass_costs") else ""
    surface = report.get("surface")
    if surface:  # what the width controller priced passes on; a cost model's is labelled simulated
        kind = "simulated (the clock's cost model)" if surface.get("simulated") else "measured on this machine"
        cells = [{"rows": r, "width": w, "ms": ms} for r, line in zip(surface["rows"], surface["ms"])
                 for w, ms in zip(surface["widths"], line)]
        costs += f"<h2>Cost surface the widths were chosen on: {html.escape(kind)}</h2>{_costs_table(cells)}"
    style = "body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;margin:1em 0}" \
            "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}code{background:#f4f4f4;padding:2px 4px}"
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>MARS serving simulation</title><style>{style}</style>"
        f"</head><body><h1>MARS serving simulation: {html.escape(str(report.get('model', '')))}</h1>"
        f"<p>Command: <code>{html.escape(report.get('command', ''))}</code>"
        f"<br>Created {html.escape(report.get('created', ''))}"
        f"<br>{html.escape(report.get('clock', ''))}</p><h2>Totals</h2>{totals}{charts}{costs}"
        f"<h2>Machine</h2>{machine}<h2>Settings</h2>"
        f"<pre>{html.escape(json.dumps(report.get('settings'), indent=1))}</pre>"
        "</body></html>"
    )


def write_report(report: dict, out_dir: str | Path, figures: list[go.Figure]) -> tuple[Path, Path | None]:
    """serve-sim.json and serve-sim.html in ``out_dir``; returns both paths (the page None without plotly)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, html_path = out_dir / "serve-sim.json", out_dir / "serve-sim.html"
    json_path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    if pio is None:
        return json_path, None
    html_path.write_text(to_html(report, figures), encoding="utf-8")
    return json_path, html_path
