"""Plotly figures for the demo, built by pure functions from decoding events.

Every builder takes the StepEvents of a run (MARS, and the AR baseline where there
is one) and returns a new ``go.Figure``; nothing here knows about Gradio, so the
figures are tested without a browser and work as well in a notebook.

Each side's clock counts only its own forward passes (the events' ``seconds``), so
a race run on a shared CPU with interleaved passes still compares like with like.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..engine.decoding.loop import StepEvent
from ..engine.decoding.metrics import Rates, common_prefix, speedup
from ..engine.decoding.tree_shape import nodes

if TYPE_CHECKING:
    from ..engine.decoding.surface import Surface
    from .sweep import FrontierPoint

MARS_COLOR = "#4f46e5"
AR_COLOR = "#94a3b8"
TAU_COLOR = "#dc2626"
EXACT_COLOR = "#0d9488"  # the sweep's exact-mode point, and a pass that verified a tree (not a chain)
# Neighbouring passes alternate between these; the MARS text pane uses the same three.
PASS_COLORS = ("#6366f1", "#0d9488", "#d97706")
HEIGHT = 300
FONT = "Inter, ui-sans-serif, system-ui, sans-serif"


def agreement_text(mars: Sequence[StepEvent], ar: Sequence[StepEvent] | None) -> str:
    """How far the two outputs agree: common prefix / the longer output, in tokens ("—" without AR)."""
    if ar is None:
        return "—"
    m, a = [t for s in mars for t in s.token_ids], [t for s in ar for t in s.token_ids]
    return f"{common_prefix(m, a)}/{max(len(m), len(a))}" + (" (identical)" if m == a and m else "")


def _style(fig: go.Figure, title: str, height: int = HEIGHT) -> go.Figure:
    fig.update_layout(
        title={"text": title, "x": 0.01, "xanchor": "left", "font": {"size": 14}},
        template="plotly_white",
        height=height,
        margin={"l": 52, "r": 20, "t": 44, "b": 44},
        font={"family": FONT, "size": 12},
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.0, "xanchor": "right", "x": 1.0},
        hoverlabel={"font": {"family": FONT}},
        paper_bgcolor="rgba(0,0,0,0)",
    )
    return fig


def _waiting(fig: go.Figure, steps: Sequence[StepEvent] | None) -> go.Figure:
    """An empty chart says so, instead of showing bare axes."""
    if not steps:
        fig.add_annotation(
            text="waiting for a run", x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False,
            font={"size": 13, "color": AR_COLOR},
        )
    return fig


def _cumulative(steps: Sequence[StepEvent]) -> tuple[list[float], list[int], list[int]]:
    """(clock in seconds, tokens so far, pass number) after each pass, starting at (0, 0)."""
    clock, tokens, passes = [0.0], [0], [0]
    for step in steps:
        clock.append(clock[-1] + step.seconds)
        tokens.append(tokens[-1] + len(step.token_ids))
        passes.append(step.index + 1)
    return clock, tokens, passes


def tokens_vs_time(mars: Sequence[StepEvent], ar: Sequence[StepEvent] | None = None) -> go.Figure:
    """Tokens generated against each side's own clock: the steeper line is the faster decoder."""
    fig = go.Figure()
    for name, steps, color in (("MARS", mars, MARS_COLOR), ("AR", ar, AR_COLOR)):
        if steps is None:
            continue
        clock, tokens, passes = _cumulative(steps)
        fig.add_trace(
            go.Scatter(
                x=clock, y=tokens, customdata=passes, name=name, mode="lines+markers",
                line={"color": color, "width": 2.5}, marker={"size": 4},
                hovertemplate=f"{name}: %{{y}} tokens after %{{x:.2f}} s (pass %{{customdata}})<extra></extra>",
            )
        )
    fig.update_xaxes(title_text="seconds (own forward passes only)", rangemode="tozero")
    fig.update_yaxes(title_text="tokens generated", rangemode="tozero")
    return _style(_waiting(fig, mars), "Tokens generated vs time")


def tokens_per_pass(mars: Sequence[StepEvent], block_size: int | None = None) -> go.Figure:
    """Tokens each MARS pass accepted (bars, in the text pane's colours) and the tau in force (line, right axis)."""
    passes = [s.index + 1 for s in mars]
    counts = [len(s.token_ids) for s in mars]
    bars = go.Bar(
        x=passes, y=counts, name="tokens accepted",
        marker={"color": [PASS_COLORS[s.index % len(PASS_COLORS)] for s in mars], "line": {"width": 0}},
        hovertemplate="pass %{x}: %{y} token(s)<extra></extra>",
    )
    tau = go.Scatter(
        x=passes, y=[s.tau for s in mars], name="tau", mode="lines", yaxis="y2",
        line={"color": TAU_COLOR, "width": 2, "shape": "hv"},
        hovertemplate="pass %{x}: tau %{y:.2f}<extra></extra>",
    )
    top = max([block_size or 1, *counts])
    fig = go.Figure([bars, tau])
    fig.update_layout(
        xaxis={"title": {"text": "forward pass"}, "rangemode": "tozero"},
        yaxis={"title": {"text": "tokens accepted"}, "range": [0, top + 0.5], "dtick": 1 if top <= 8 else None},
        yaxis2={"title": {"text": "tau"}, "range": [0, 1.05], "overlaying": "y", "side": "right", "showgrid": False},
        bargap=0.15,
    )
    return _style(_waiting(fig, mars), "MARS: tokens accepted per pass, with tau")


def passes_histogram(mars: Sequence[StepEvent], block_size: int | None = None) -> go.Figure:
    """How many MARS passes accepted 1, 2, ... B tokens; the mean is tokens per forward pass."""
    counts = Counter(len(s.token_ids) for s in mars)
    top = max([block_size or 1, *counts]) if counts else block_size or 1
    sizes = list(range(1, top + 1))
    heights = [counts.get(k, 0) for k in sizes]
    fig = go.Figure(
        go.Bar(
            x=sizes, y=heights, name="passes", marker={"color": MARS_COLOR}, text=[h or "" for h in heights],
            textposition="outside", cliponaxis=False,
            hovertemplate="%{y} pass(es) accepted %{x} token(s)<extra></extra>",
        )
    )
    mean = Rates.of_steps(mars).tokens_per_forward
    title = "MARS: passes by tokens accepted"
    if mars:
        fig.add_vline(x=mean, line={"color": TAU_COLOR, "dash": "dot", "width": 2})
        title += f" · mean {mean:.2f} (dotted)"
    fig.update_xaxes(title_text="tokens accepted in one pass", dtick=1, range=[0.4, top + 0.6])
    fig.update_yaxes(title_text="passes", rangemode="tozero")
    return _style(_waiting(fig, mars), title)


def _fmt(value: float | None, pattern: str) -> str:
    return "—" if value is None else format(value, pattern)


def width_text(steps: Sequence[StepEvent]) -> str:
    """The widths the passes after the prefill fed, in one cell: "1-4, mostly 3" ("—" before any)."""
    widths = Counter(s.width for s in steps[1:] if s.width)
    if not widths:
        return "—"
    low, high, most = min(widths), max(widths), widths.most_common(1)[0][0]
    return str(low) if low == high else f"{low}–{high}, mostly {most}"


def shape_text(shape: Sequence[int]) -> str:
    """A pass's tree shape (StepEvent.shape) as the app names it: "no drafts", "chain of 3" or "2,1,1"."""
    if not shape:
        return "no drafts"
    return f"chain of {len(shape)}" if max(shape) == 1 else ",".join(map(str, shape))


def tree_shares(steps: Sequence[StepEvent]) -> list[tuple[str, float]]:
    """(kind, % of passes) of the shapes the passes after the prefill verified, most common first (ties: first
    seen): chains of any depth together as "chains", trees by shape, past the third as "other shapes"."""
    kinds = Counter("chains" if s.shape and max(s.shape) == 1 else shape_text(s.shape) for s in steps[1:])
    total, top = sum(kinds.values()), kinds.most_common(3)
    rest = total - sum(n for _, n in top)
    return [(kind, 100 * n / total) for kind, n in top + ([("other shapes", rest)] if rest else [])]


def tree_text(steps: Sequence[StepEvent], tree: str | None) -> str:
    """``tree_shares`` in one line: "auto: chains on 80% of passes, 2,1,1 on 20%"; "—" without a tree or before
    a pass after the prefill."""
    shares = [f"{kind} on {share:.0f}%" for kind, share in tree_shares(steps)]
    if tree is None or not shares:
        return "—"
    return f"{tree}: {shares[0]} of passes" + "".join(f", {part}" for part in shares[1:])


def tree_shapes(steps: Sequence[StepEvent], tree: str | None = None) -> go.Figure:
    """Exact and hybrid modes: the drafts each pass verified (bars, one per pass: a tree's nodes, a chain's
    depth; a tree in teal) and the depth they reached (line); the shape on hover, its shares in the title."""
    passes = [s.index + 1 for s in steps]
    bars = go.Bar(
        x=passes, y=[nodes(tuple(s.shape)) for s in steps], customdata=[shape_text(s.shape) for s in steps],
        name="drafts verified (teal: a tree)", hovertemplate="pass %{x}: %{customdata}, %{y} draft(s)<extra></extra>",
        marker={"color": [EXACT_COLOR if s.shape and max(s.shape) > 1 else MARS_COLOR for s in steps]},
    )
    depth = go.Scatter(
        x=passes, y=[len(s.shape) for s in steps], name="depth", mode="lines", line={"color": TAU_COLOR, "shape": "hv"},
        hovertemplate="pass %{x}: depth %{y}<extra></extra>",
    )
    fig = go.Figure([bars, depth])
    fig.update_xaxes(title_text="forward pass", rangemode="tozero")
    fig.update_yaxes(title_text="drafts verified", rangemode="tozero", dtick=1 if max([0, *bars.y]) <= 8 else None)
    shares = tree_text(steps, tree)
    title = "Candidate trees: drafts verified per pass" + (f"<br><sup>tree {shares}</sup>" if shares != "—" else "")
    return _style(_waiting(fig, steps), title, height=260)


def summary_table(
    mars: Sequence[StepEvent], ar: Sequence[StepEvent] | None = None, nll: dict[str, float] | None = None,
    tree: str | None = None,
) -> go.Figure:
    """Tokens/s, tokens/forward, passes, time and speedup over AR, for both sides.

    ``nll``: a sampled race (None: greedy). Two samples need not share a token, so in place of "same tokens
    as AR" each side's NLL per token under the model, once the run has ended ("—" before). ``tree``: the run's
    DecodeConfig.tree (exact and hybrid modes), a row with the shapes its passes verified (``tree_text``).
    """
    m = Rates.of_steps(mars)
    a = Rates.of_steps(ar) if ar is not None else None
    same = ("same tokens as AR", agreement_text(mars, ar), "—")
    if nll is not None:
        same = ("NLL / token under the model", _fmt(nll.get("mars"), ".3f"), _fmt(nll.get("ar"), ".3f"))
    rows = [
        ("tokens", _fmt(m.tokens, "d"), _fmt(a and a.tokens, "d")),
        ("forward passes", _fmt(m.forward_passes, "d"), _fmt(a and a.forward_passes, "d")),
        ("tokens / forward", _fmt(m.tokens_per_forward, ".2f"), _fmt(a and a.tokens_per_forward, ".2f")),
        ("time, own passes (s)", _fmt(m.seconds, ".2f"), _fmt(a and a.seconds, ".2f")),
        ("tokens / s", _fmt(m.tokens_per_second, ".1f"), _fmt(a and a.tokens_per_second, ".1f")),
        ("speedup over AR", _fmt(speedup(m, a), ".2f") + ("×" if speedup(m, a) else ""), "1.00×" if a else "—"),
        same,
        ("width (chosen for tokens / ms)", width_text(mars), width_text(ar or [])),
    ]
    shares = tree_shares(mars) if tree is not None else []
    if tree is not None:  # one share a line: the column is narrow
        rows.append((tree_label(tree), "<br>".join(f"{kind} {share:.0f}%" for kind, share in shares) or "—", "—"))
    labels, mars_col, ar_col = (list(col) for col in zip(*rows))
    fig = go.Figure(
        go.Table(
            columnwidth=[1.6, 1, 1],
            header={
                "values": ["", "<b>MARS</b>", "<b>AR</b>"], "fill_color": ["white", MARS_COLOR, AR_COLOR],
                "font": {"color": "white", "size": 13}, "align": ["left", "center", "center"], "height": 30,
            },
            cells={
                "values": [labels, mars_col, ar_col], "align": ["left", "center", "center"], "height": 30,
                "fill_color": [["#f8fafc", "white"] * 5], "font": {"size": 13, "color": "#1f2937"},
                "line": {"color": "#e5e7eb"},
            },
        )
    )
    return _style(fig, "Summary", height=380 + (30 + 20 * max(len(shares), 2) if tree is not None else 0))


def tree_label(tree: str) -> str:
    """The summary table's row of a tree run's shapes (``tree``: a checked DecodeConfig.tree, digits or "auto")."""
    return f"candidate tree ({tree}): passes by shape"


def frontier(points: Sequence[FrontierPoint]) -> go.Figure:
    """The sweep's speed/quality frontier: tokens/forward and speedup against agreement with the reference.

    The tau points are one dotted line (agreement with the tau = 1.0 output); exact mode is a point of its
    own (a diamond; agreement with the AR baseline's output). Every label is made here from numbers.
    """
    fig = make_subplots(
        rows=1, cols=2, horizontal_spacing=0.12,
        subplot_titles=("tokens per forward pass", "measured speedup over AR"),
    )
    taus = sorted((p for p in points if p.mode != "exact"), key=lambda p: p.tau, reverse=True)
    exact = [p for p in points if p.mode == "exact"]
    for col, value in ((1, lambda p: p.tokens_per_forward), (2, lambda p: p.speedup)):
        fig.add_trace(
            go.Scatter(
                x=[p.agreement for p in taus], y=[value(p) for p in taus], text=[f"τ={p.label}" for p in taus],
                name="MARS", mode="lines+markers+text", textposition=["top center", "bottom center"] * len(taus),
                marker={"size": 10, "color": MARS_COLOR}, line={"color": MARS_COLOR, "width": 1.5, "dash": "dot"},
                showlegend=False, hovertemplate="%{text}: %{y:.2f} at agreement %{x:.3f}<extra></extra>",
            ),
            row=1, col=col,
        )
        if exact:
            fig.add_trace(
                go.Scatter(
                    x=[p.agreement for p in exact], y=[value(p) for p in exact], text=["exact"] * len(exact),
                    name="exact", mode="markers+text", textposition="middle left",
                    marker={"size": 13, "color": EXACT_COLOR, "symbol": "diamond"}, showlegend=False,
                    hovertemplate="exact mode: %{y:.2f} at agreement %{x:.3f} with the AR output<extra></extra>",
                ),
                row=1, col=col,
            )
    fig.add_hline(y=1.0, line={"color": AR_COLOR, "dash": "dash"}, row=1, col=2)
    fig.update_xaxes(title_text="agreement with the tau = 1.0 output (exact: with AR's)", range=[-0.02, 1.08])
    fig.update_yaxes(rangemode="tozero")
    fig = _style(fig, "Speed / quality frontier", height=400)
    fig.update_layout(margin={"t": 72})
    return fig


# -- serving (the Serving tab and serve-sim's report): one line per policy, x = the replay's clock --------------
SERVING_LAYOUT = {"template": "plotly_white", "height": 300, "margin": {"l": 50, "r": 10, "t": 40, "b": 40},
                  "legend": {"orientation": "h", "y": -0.25}}


def _serving_lines(
    curves: dict[str, tuple[list, list]], title: str, y_title: str, shape: str = "linear", markers=False
) -> go.Figure:
    fig = go.Figure([
        go.Scatter(x=x, y=y, name=name, mode="lines+markers" if markers else "lines", line={"shape": shape})
        for name, (x, y) in curves.items()
    ])
    fig.update_layout(title=title, xaxis_title="clock (s)", yaxis_title=y_title, **SERVING_LAYOUT)
    return fig


def tau_over_time(all_series: dict[str, dict]) -> go.Figure:
    fig = _serving_lines({n: (s["clock"], s["tau"]) for n, s in all_series.items()}, "tau per pass", "tau", "hv")
    fig.update_yaxes(range=[0, 1.05])
    return fig


def width_over_time(all_series: dict[str, dict]) -> go.Figure:
    """Columns each decoding pass fed per row: the width controller's choice (1: plain AR passes)."""
    curves = {n: (s["clock"], s.get("width", [])) for n, s in all_series.items()}
    return _serving_lines(curves, "Width per pass (tokens fed per row)", "width", "hv")


def surface_heatmap(surface: Surface) -> go.Figure:
    """The cost surface: ms of a pass by rows and tokens fed per row, labelled simulated where it is a cost model."""
    widths = [w for w in surface.widths if w <= 16]
    ms = [[surface.ms(r, w) for w in widths] for r in surface.rows]
    fig = go.Figure(go.Heatmap(
        x=[str(w) for w in widths], y=[str(r) for r in surface.rows], z=ms, colorscale="Viridis",
        text=[[f"{x:.1f}" for x in line] for line in ms], texttemplate="%{text}",
        hovertemplate="%{y} rows x %{x} tokens: %{z:.2f} ms<extra></extra>", colorbar={"title": "ms"},
    ))
    kind = "simulated " if surface.simulated else "measured "
    fig.update_layout(title=f"Cost of a pass ({kind}surface, ms)", xaxis_title="tokens fed per row",
                      yaxis_title="rows", **SERVING_LAYOUT)
    return fig


def queue_over_time(all_series: dict[str, dict]) -> go.Figure:
    curves = {n: (s["clock"], s["queue"]) for n, s in all_series.items()}
    return _serving_lines(curves, "Requests waiting", "queue", "hv")


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
    fig = _serving_lines({n: rolling_throughput(s, window) for n, s in all_series.items()},
                 f"Throughput (tokens/s over {window:.0f} s)", "tokens / s")
    return fig


def latency_over_time(all_series: dict[str, dict]) -> go.Figure:
    return _serving_lines({n: (s["finished_at"], s["latency"]) for n, s in all_series.items()},
                  "Latency of each finished request", "latency (s)", markers=True)


def serving_figures(all_series: dict[str, dict]) -> list[go.Figure]:
    """tau, queue, throughput, latency and width over time: the charts of the report and of the app."""
    return [tau_over_time(all_series), queue_over_time(all_series), throughput_over_time(all_series),
            latency_over_time(all_series), width_over_time(all_series)]
