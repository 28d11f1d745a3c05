"""Each handler's outputs by name: the one place the order of app.py's component lists lives.

A handler returns ``outputs(NAMES, name=value, ...)``; app.py lists the components in the order
of ``NAMES`` once, and a test reads a returned tuple back by name (``named``). Adding a component
to a handler means a name here, a component in app.py under that name, and its value in the handler.
"""

from __future__ import annotations

import gradio as gr

from . import charts

# Each handler's outputs by name, in the order app.py lists the components: the one place that order lives.
RACE_OUTPUTS = ("mars_pane", "ar_pane", "time_plot", "pass_plot", "hist_plot", "summary_plot", "tree_plot", "json_file",
                "csv_file")
MODEL_OUTPUTS = ("model_line", "model", "block_size", "precision")
SWEEP_OUTPUTS = ("sweep_status", "sweep_plot", "sweep_table")


def outputs(names: tuple[str, ...], **values) -> tuple:
    """Values keyed by output name, as the tuple Gradio expects for ``names``, each sent as an update
    (``gr.update(value=...)``); gr.skip() for those not given.

    Why updates: Gradio (6.31) keeps every session's latest component values until the session
    is evicted. gr.skip() replaces the session's copy of a component with a new one under a new
    id, and a plain value sent after that is stored under that new id, beside the old entry. A
    run that alternated skips and plain values added a copy of a pane or a figure to its
    session per pass (docs/soak.md, "Memory growth"); an update replaces the entry in place.
    """
    unknown = set(values) - set(names)
    if unknown:
        raise KeyError(f"not an output of this handler: {', '.join(sorted(unknown))}")
    return tuple(_as_update(values[name]) if name in values else gr.skip() for name in names)


def _as_update(value):
    return value if isinstance(value, dict) and value.get("__type__") == "update" else gr.update(value=value)


def named(names: tuple[str, ...], values: tuple) -> dict:
    """A handler's output tuple back as a dict by name (tests, notebooks); an update that carries
    only a value comes back as that value, gr.skip() and updates of other properties as they are."""
    return {name: _value_only(value) for name, value in zip(names, values, strict=True)}


def _value_only(value):
    if isinstance(value, dict) and value.keys() == {"__type__", "value"} and value["__type__"] == "update":
        return value["value"]
    return value


def empty_figures() -> dict:
    return {
        "time_plot": charts.tokens_vs_time([], []),
        "pass_plot": charts.tokens_per_pass([]),
        "hist_plot": charts.passes_histogram([]),
        "summary_plot": charts.summary_table([], []),
        "tree_plot": charts.tree_shapes([]),  # shown for exact and hybrid runs only
    }
