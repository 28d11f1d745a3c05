"""Turning a benchmark report (bench.run_benchmark's dict) into a text table and an offline HTML page.

Chart builders are pure functions returning plotly Figures; the page inlines
plotly.js once, so it opens without a network.
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

from .benchmark import TAU_METHODS
from .tables import cell, text_table

COLUMNS = (  # (key, header, format)
    ("method", "method", "{}"),
    ("tau", "tau", "{:.2f}"),
    ("batch_size", "batch", "{}"),
    ("tokens_per_second", "tok/s", "{:.1f}"),
    ("tokens_per_forward", "tok/fwd", "{:.2f}"),
    ("forward_passes", "passes", "{}"),
    ("tokens", "tokens", "{}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("speedup_range", "by repeat", "{0[0]:.2f}-{0[1]:.2f}"),  # bench --repeats only
    ("tail_share", "tail", "{:.2f}"),  # our batch decoders only
    ("delta_nll_self", "dNLL self", "{:+.3f}"),
    ("agreement", "agree", "{:.3f}"),
    ("agreement_fp32", "agree fp32", "{:.3f}"),  # bench --fp32-reference only
)


def format_table(runs: list[dict]) -> str:
    """A fixed-width text table of the runs, one line each."""
    return text_table(runs, COLUMNS, left=1)


def _label(run: dict) -> str:
    tau = "" if run["tau"] is None or run["method"] not in TAU_METHODS else f" tau={run['tau']:g}"
    return f"{run['method']}{tau} b={run['batch_size']}"


def speed_by_tau(runs: list[dict]) -> go.Figure:
    """Tokens/s against tau for each MARS method and batch size; AR baselines as dashed lines."""
    fig = go.Figure()
    groups: dict[tuple[str, int], list[dict]] = {}
    for run in runs:
        groups.setdefault((run["method"], run["batch_size"]), []).append(run)
    taus = sorted({r["tau"] for r in runs if r["tau"] is not None})
    for (method, batch), items in groups.items():
        name = f"{method} b={batch}"
        if method in TAU_METHODS:
            items = sorted(items, key=lambda r: r["tau"])
            fig.add_trace(go.Scatter(
                x=[r["tau"] for r in items], y=[r["tokens_per_second"] for r in items], mode="lines+markers", name=name,
            ))
        elif taus:
            y = items[0]["tokens_per_second"]
            fig.add_trace(go.Scatter(x=[taus[0], taus[-1]], y=[y, y], mode="lines", line={"dash": "dash"}, name=name))
    fig.update_layout(title="Throughput against tau", xaxis_title="tau", yaxis_title="tokens / s",
                      template="plotly_white")
    return fig


FAMILIES = {  # bench method -> the line it belongs to across batch sizes (speed_by_batch)
    "ar": "our AR", "ar_batch_ours": "our AR", "mars": "MARS", "mars_batch_token": "MARS",
    "mars_batch": "MARS, block scheme", "mars_exact": "exact mode", "exact_batch": "exact mode",
    "hf_generate": "transformers generate", "ar_batch": "transformers generate",
    "llama_cpp": "llama.cpp Q8_0", "llama_cpp_q4": "llama.cpp Q4_1",
}


def speed_by_batch(runs: list[dict]) -> go.Figure:
    """Tokens/s against batch size: one line per decoder (a one-sequence method and its batched form together, MARS
    per tau), so batched AR, MARS, exact mode and llama.cpp are read side by side as rows are added."""
    lines: dict[str, list[dict]] = {}
    for run in runs:
        name = FAMILIES.get(run["method"], run["method"])
        if run["method"] in TAU_METHODS:
            name += f" tau={run['tau']:g}"
        lines.setdefault(name, []).append(run)
    fig = go.Figure([
        go.Scatter(x=[r["batch_size"] for r in items], y=[r["tokens_per_second"] for r in items],
                   mode="lines+markers", name=name)
        for name, items in ((n, sorted(i, key=lambda r: r["batch_size"])) for n, i in lines.items())
    ])
    fig.update_layout(title="Throughput by batch size (all rows together)", xaxis_title="batch size (rows)",
                      yaxis_title="tokens / s", xaxis={"type": "log", "dtick": 0.30103}, template="plotly_white")
    return fig


def speed_quality(runs: list[dict]) -> go.Figure:
    """Speed-up against quality loss (dNLL), one point per run."""
    fig = go.Figure()
    for method in dict.fromkeys(r["method"] for r in runs):
        items = [r for r in runs if r["method"] == method and r.get("speedup") is not None]
        fig.add_trace(go.Scatter(
            x=[r["delta_nll_self"] for r in items], y=[r["speedup"] for r in items], mode="markers", name=method,
            text=[
                f"{_label(r)}<br>agreement {r['agreement']:.3f}<br>{r['tokens_per_forward']:.2f} tok/fwd"
                for r in items
            ],
            hovertemplate="%{text}<br>dNLL %{x:+.3f}<br>speed-up %{y:.2f}x<extra></extra>", marker={"size": 10},
        ))
    fig.add_hline(y=1.0, line_dash="dot", line_color="grey")
    fig.update_layout(title="Speed-up over the faster AR (same batch size) against dNLL",
                      xaxis_title="dNLL (nats / token)", yaxis_title="speed-up", template="plotly_white")
    return fig


def tokens_per_forward(runs: list[dict]) -> go.Figure:
    labels = [_label(r) for r in runs]
    fig = go.Figure(go.Bar(x=labels, y=[r["tokens_per_forward"] for r in runs], marker_color="#4c78a8"))
    fig.update_layout(title="Tokens per forward pass (per live row)", yaxis_title="tokens / forward",
                      template="plotly_white")
    return fig


def pass_profile(profile: dict) -> go.Figure:
    """Stacked milliseconds per pass: model body, LM head, acceptance and host work."""
    modes = [m for m in ("mars", "mars_full_window", "ar") if m in profile]
    parts = [k for k in profile[modes[0]]["ms_per_pass"] if k != "total"] if modes else []
    fig = go.Figure([
        go.Bar(name=part, x=[f"{m} (tau={profile['tau']:g})" if m.startswith("mars") else m for m in modes],
               y=[profile[m]["ms_per_pass"][part] for m in modes])
        for part in parts
    ])
    fig.update_layout(barmode="stack", title="Where a batch-1 pass spends its time", yaxis_title="ms / pass",
                      template="plotly_white")
    return fig


def _html_table(rows: list[list[str]], header: list[str]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def to_html(report: dict) -> str:
    """One self-contained page: command, machine, charts (plotly.js inlined once), the runs table."""
    runs = report["runs"]
    figures = [speed_quality(runs)]
    if len({r["batch_size"] for r in runs}) > 1:
        figures.append(speed_by_batch(runs))
    if any(r["method"] in TAU_METHODS for r in runs):  # without a tau method every line is one point at tau 1
        figures.append(speed_by_tau(runs))
    figures.append(tokens_per_forward(runs))
    if report.get("profile"):
        figures.append(pass_profile(report["profile"]))
    charts = "".join(
        pio.to_html(fig, full_html=False, include_plotlyjs=(i == 0), default_height="460px")
        for i, fig in enumerate(figures)
    )
    machine = _html_table([[k, str(v)] for k, v in report["machine"].items()], ["", ""])
    table = _html_table([[cell(r.get(k), f) for k, _, f in COLUMNS] for r in runs], [h for _, h, _ in COLUMNS])
    style = "body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;margin:1em 0}" \
            "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}code{background:#f4f4f4;padding:2px 4px}"
    settings = json.dumps({"settings": report.get("settings"), "profile": report.get("profile")}, indent=1)
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>MARS benchmark</title><style>{style}</style>"
        "</head><body>"
        f"<h1>MARS benchmark: {html.escape(str(report.get('model', '')))}</h1>"
        f"<p>Command: <code>{html.escape(report.get('command', ''))}</code>"
        f"<br>Created {html.escape(report.get('created', ''))}</p>"
        f"<h2>Machine</h2>{machine}<h2>Runs</h2>{table}{charts}"
        f"<h2>Settings and profile</h2><pre>{html.escape(settings)}</pre>"
        "</body></html>"
    )


def write_report(report: dict, json_path: str | Path) -> Path | None:
    """Write ``report.json`` and the HTML page beside it (same name, .html); returns the HTML path,
    None where plotly is not installed (the JSON alone)."""
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if pio is None:
        return None
    html_path = json_path.with_suffix(".html")
    html_path.write_text(to_html(report), encoding="utf-8")
    return html_path
