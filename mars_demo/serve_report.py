"""Charts and the report of a serving simulation (serve_sim.py): one curve per policy.

Pure figure builders (the app's Serving tab draws the same ones live), a text table of
the totals, and one self-contained HTML page (plotly.js inlined once, no network).
Everything shown is numbers or policy names; text goes through html.escape.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import plotly.graph_objects as go
import plotly.io as pio

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
    ("tokens_per_forward", "tok/fwd", "{:.2f}"),
    ("delta_nll", "dNLL", "{:+.4f}"),
    ("agreement", "agree", "{:.3f}"),
)
LAYOUT = {"template": "plotly_white", "height": 300, "margin": {"l": 50, "r": 10, "t": 40, "b": 40},
          "legend": {"orientation": "h", "y": -0.25}}


def _cell(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def totals_rows(summaries: list[dict]) -> list[list[str]]:
    return [[_cell(s.get(key), fmt) for key, _, fmt in TOTALS] for s in summaries]


def format_totals(summaries: list[dict]) -> str:
    """A fixed-width text table, one line per policy."""
    rows = [[header for _, header, _ in TOTALS], *totals_rows(summaries)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(TOTALS))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _lines(curves: dict[str, tuple[list, list]], title: str, y_title: str, shape: str = "linear", markers=False) -> go.Figure:
    fig = go.Figure([
        go.Scatter(x=x, y=y, name=name, mode="lines+markers" if markers else "lines", line={"shape": shape})
        for name, (x, y) in curves.items()
    ])
    fig.update_layout(title=title, xaxis_title="clock (s)", yaxis_title=y_title, **LAYOUT)
    return fig


def tau_over_time(all_series: dict[str, dict]) -> go.Figure:
    fig = _lines({n: (s["clock"], s["tau"]) for n, s in all_series.items()}, "tau per pass", "tau", "hv")
    fig.update_yaxes(range=[0, 1.05])
    return fig


def queue_over_time(all_series: dict[str, dict]) -> go.Figure:
    return _lines({n: (s["clock"], s["queue"]) for n, s in all_series.items()}, "Requests waiting", "queue", "hv")


def rolling_throughput(series: dict, window: float) -> tuple[list[float], list[float]]:
    """Tokens per second over the last ``window`` seconds of clock, at every iteration."""
    clock, tokens = series["clock"], series["tokens"]
    out, start, inside = [], 0, 0
    for i, t in enumerate(clock):
        inside += tokens[i]
        while clock[start] <= t - window:
            inside -= tokens[start]
            start += 1
        out.append(round(inside / window, 2))
    return list(clock), out


def throughput_over_time(all_series: dict[str, dict]) -> go.Figure:
    span = max((s["clock"][-1] for s in all_series.values() if s["clock"]), default=1.0)
    window = max(span / 20, 1.0)
    fig = _lines({n: rolling_throughput(s, window) for n, s in all_series.items()},
                 f"Throughput (tokens/s over {window:.0f} s)", "tokens / s")
    return fig


def latency_over_time(all_series: dict[str, dict]) -> go.Figure:
    return _lines({n: (s["finished_at"], s["latency"]) for n, s in all_series.items()},
                  "Latency of each finished request", "latency (s)", markers=True)


def figures(all_series: dict[str, dict]) -> list[go.Figure]:
    """tau, queue, throughput and latency over time: the four charts of the report and of the app."""
    return [tau_over_time(all_series), queue_over_time(all_series), throughput_over_time(all_series),
            latency_over_time(all_series)]


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


def to_html(report: dict) -> str:
    """One self-contained page: command, machine, totals, the four charts, pass costs, settings."""
    all_series = {p["summary"]["policy"]: p["series"] for p in report["policies"]}
    charts = "".join(
        pio.to_html(fig, full_html=False, include_plotlyjs=(i == 0), default_height="320px")
        for i, fig in enumerate(figures(all_series))
    )
    totals = _html_table(totals_rows([p["summary"] for p in report["policies"]]), [h for _, h, _ in TOTALS])
    machine = _html_table([[k, str(v)] for k, v in report.get("machine", {}).items()], ["", ""])
    costs = f"<h2>Cost per pass (ms)</h2>{_costs_table(report['pass_costs'])}" if report.get("pass_costs") else ""
    style = "body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;margin:1em 0}" \
            "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}code{background:#f4f4f4;padding:2px 4px}"
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>MARS serving simulation</title><style>{style}</style>"
        f"</head><body><h1>MARS serving simulation: {html.escape(str(report.get('model', '')))}</h1>"
        f"<p>Command: <code>{html.escape(report.get('command', ''))}</code><br>Created {html.escape(report.get('created', ''))}"
        f"<br>{html.escape(report.get('clock', ''))}</p><h2>Totals</h2>{totals}{charts}{costs}"
        f"<h2>Machine</h2>{machine}<h2>Settings</h2><pre>{html.escape(json.dumps(report.get('settings'), indent=1))}</pre>"
        "</body></html>"
    )


def write_report(report: dict, out_dir: str | Path) -> tuple[Path, Path]:
    """serve-sim.json and serve-sim.html in ``out_dir``; returns both paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, html_path = out_dir / "serve-sim.json", out_dir / "serve-sim.html"
    json_path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    html_path.write_text(to_html(report), encoding="utf-8")
    return json_path, html_path
