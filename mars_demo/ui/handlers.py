"""The app's event handlers: they turn engine events into component values, and nothing more.

The run handler is a generator that decodes as Gradio pulls from it: MARS and AR
passes alternate (``race.interleave``) and a yield carries the panes that changed
since the last one, when ``race.LaneCadence`` says a view is due (``view_every``: a
side's own decoding seconds between views; 0, the default here, a yield per pass;
the app uses ``race.VIEW_EVERY`` and waits ``view_settle`` after each view, off both
clocks, so that the UI's work costs both sides the same). There is no helper thread and no replay.
Stop cancels the run (``cancels=``) and marks its trace stopped, so the generator
ends at the next pass boundary; Stop's own handler waits for that end before it
shows the final view, so no earlier pass can land on top of it. The session's
LiveTau is the object the decoder reads before every pass; ``set_tau`` (the
slider's change event, never queued behind a run) writes to it while the run goes.

Toasts (gr.Warning / gr.Error) are built in ``messages.py``: plain text for API
clients, escaped for the browser. Models go through the hosting policy and are held
by a run for as long as it decodes (``models.py``), keyed by checkpoint and CPU compute path
(the sidebar's setting, checked like ``--precision``; ignored on a GPU): MARS and AR in a race,
the sweep and the Serving tab decode on the one model their run holds. Trace files live in a bounded
``TraceStore`` (``traces.py``). The handlers object reaches the model, so nothing in
the component config may reach it: the app hands Gradio only plain functions.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from html import escape
from pathlib import Path

import gradio as gr
import torch

from ..engine.config import DecodeConfig
from ..engine.decoding import generate
from ..engine.kernels import check_precision
from ..engine.loading import load_for_decoding
from ..engine.memory import ModelTooLarge, check_fits, trim_heap
from . import charts
from .messages import error, sentence, warning
from .models import Loader, ModelBusy, ModelCache, ModelPolicy, ModelRefused, bundled_note, default_compute_path
from .race import LaneCadence, RaceTrace, Session, interleave, upcoming_side
from .render import ar_pane, mars_pane, model_message, model_status
from .sweep import frontier, plan, sweep_runs
from .traces import TraceStore, stem
from .zerogpu import on_zero_gpu

logger = logging.getLogger(__name__)

SWEEP_COLUMNS = ["tau", "prompts", "tokens / forward", "tokens / s", "speedup over AR", "agreement", "exact match"]
# Each handler's outputs by name, in the order app.py lists the components: the one place that order lives.
RACE_OUTPUTS = ("mars_pane", "ar_pane", "time_plot", "pass_plot", "hist_plot", "summary_plot", "json_file", "csv_file")
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
    }


BUSY = ("Another model is in use by other visitors' runs right now: "
        "try again once they finish, or keep the model that is loaded.")


class DemoHandlers:
    """Handlers bound to one model cache; ``loader`` is injectable so tests use a tiny model."""

    def __init__(
        self,
        loader: Loader = load_for_decoding,
        *,
        capacity: int = 1,
        policy: ModelPolicy | None = None,
        chart_every: float = 1.0,
        trace_dir: str | Path | None = None,
        traces: TraceStore | None = None,
        stop_wait: float = 10.0,
        guard: Callable[..., None] | None = check_fits,
        gpu: bool | None = None,
        view_every: float = 0.0,
        view_settle: float = 0.0,
    ) -> None:
        self.models = ModelCache(loader, capacity, guard)  # guard: refuses a model that would not fit in memory
        # On a GPU the compute-path setting is ignored: CUDA decodes in bf16 (MARS_DEMO_PRECISION=fp32 keeps fp32).
        self.on_gpu = (torch.cuda.is_available() or on_zero_gpu()) if gpu is None else gpu
        self.policy = policy or ModelPolicy.from_env()
        self.chart_every = chart_every  # seconds between chart refreshes while a run streams
        self.view_every = view_every  # a side's decoding seconds between two views of the race (race.LaneCadence)
        self.view_settle = view_settle  # seconds the race waits after a view, off both clocks, while it is drawn
        self.traces = traces or TraceStore(trace_dir or Path(tempfile.gettempdir()) / "mars_demo_traces")
        self.stop_wait = stop_wait  # most seconds Stop waits for the run to end (one forward pass)

    # -- model -----------------------------------------------------------------------------
    def _refusal(self, spec: str | None, err: Exception) -> str:
        """The message for a model that cannot be served; details go to the server log only."""
        if isinstance(err, ModelBusy):
            return BUSY
        if isinstance(err, ModelTooLarge) and (spec or "").strip() in self.policy.specs:
            return str(err)  # sizes only; a typed spec gets the one refusal below
        if not isinstance(err, ModelRefused):
            logger.warning("cannot load %r: %s", spec, err)
        return self.policy.refusal

    def compute_path(self, precision: str | None) -> str | None:
        """The sidebar's compute path as the model cache's key: checked as ``--precision`` is (a ValueError
        with one line), None (the default) is MARS_DEMO_PRECISION or auto, and on a GPU it is None: ignored."""
        precision = check_precision(default_compute_path()[0] if precision is None else precision)
        return None if self.on_gpu else precision

    def _path(self, precision: str | None, request: gr.Request | None) -> str | None:
        try:
            return self.compute_path(precision)
        except ValueError as err:
            raise error(sentence(str(err)), "Bad setting", request) from None

    def show_model(self, spec: str | None, session: Session, precision: str | None = None,
                   request: gr.Request = None) -> Iterator[tuple]:
        """Load the picked model on the picked compute path (page load, picker or path change); on failure
        keep the previous ones.

        Outputs: status line, model picker, block-size slider, compute-path setting.
        """
        self.traces.prune()  # page loads also age out the traces of API sessions
        try:
            path = self.compute_path(precision)
        except ValueError as err:
            yield self._kept(sentence(str(err)), session, "Bad setting", request, session.spec)
            return
        try:
            spec = self.policy.check(spec)
            if not self.models.has(spec, path):
                loading = f"Loading {spec}… (a download or a first conversion can take a while)"
                yield outputs(MODEL_OUTPUTS, model_line=model_message(loading))
            lm = self.models.get(spec, path)
        except Exception as err:  # noqa: BLE001 - any failure to load is the visitor's to read, not a crash
            same = (session.spec, session.precision) == (spec, precision)
            yield self._kept(self._refusal(spec, err), session, "Model not loaded", request,
                             session.spec if not same else self.policy.specs[0])
            return
        session.spec, session.precision = spec, precision
        status = model_status(
            lm.name, lm.meta.block_size, lm.meta.mask_token, lm.load_seconds, bundled_note(spec),
            compute=lm.compute.summary() if lm.compute is not None else "",
        )
        yield outputs(MODEL_OUTPUTS, model_line=status, block_size=gr.update(value=lm.meta.block_size))

    def _kept(self, text: str, session: Session, title: str, request: gr.Request | None, keep: str) -> tuple:
        """The status line and toast for a model or path not served; the picker and the path go back."""
        text = sentence(text, f"Still serving {keep}")
        warning(text, title, request)
        return outputs(MODEL_OUTPUTS, model_line=model_message(text, "error"), model=gr.update(value=keep),
                       precision=gr.update(value=session.precision or default_compute_path()[0]))

    def _hold(self, spec: str | None, stack: ExitStack, request: gr.Request | None, path: str | None = None):
        """The model for a run on compute path ``path`` (from ``_path``; None: the setting's default), held (never
        dropped) until ``stack`` closes."""
        try:
            path = self.compute_path(None) if path is None else path
            return stack.enter_context(self.models.hold(self.policy.check(spec), path))
        except Exception as err:  # noqa: BLE001 - refused with one message; the reason goes to the log
            raise error(self._refusal(spec, err), "Model not loaded", request) from None

    # -- tau -------------------------------------------------------------------------------
    def set_tau(self, value: float, session: Session) -> None:
        """The slider's change event: the running decoder reads the new tau before its next pass."""
        session.tau.set(float(value))

    # -- the race --------------------------------------------------------------------------
    def _config(
        self, tau, block_size, max_new_tokens, metric, temperature, full_window=False, request=None, mode="mars"
    ) -> DecodeConfig:
        try:
            return DecodeConfig(
                mode=mode, tau=float(tau), block_size=int(block_size), max_new_tokens=int(max_new_tokens),
                metric=metric, temperature=float(temperature), max_fed=None if full_window else "auto",
            )
        except (TypeError, ValueError) as err:
            raise error(sentence(str(err)), "Bad setting", request) from None

    def _outputs(self, trace: RaceTrace, panes: tuple[str, ...], charts_due: bool, files: bool | None, session: Session,
                 owner: str | None = None) -> tuple:
        """RACE_OUTPUTS: both panes, four figures, the JSON and CSV download buttons.

        gr.skip() for what did not change.
        """
        mars, ar = trace.steps("mars"), trace.steps("ar")
        out: dict = {}
        if "mars" in panes:
            status = _side_status(trace, "mars")
            out["mars_pane"] = mars_pane(mars, status, trace.finish_reason("mars"), trace.config.mode)
        if "ar" in panes:
            out["ar_pane"] = ar_pane(ar, _side_status(trace, "ar"), trace.finish_reason("ar"))
        if charts_due:
            block = trace.config.block_size
            out |= {
                "time_plot": charts.tokens_vs_time(mars, ar),
                "pass_plot": charts.tokens_per_pass(mars, block),
                "hist_plot": charts.passes_histogram(mars, block),
                "summary_plot": charts.summary_table(mars, ar),
            }
        if files is True:
            json_path, csv_path = self.traces.write(trace, stem(session.id), owner)
            out["json_file"] = gr.update(value=str(json_path), interactive=True)
            out["csv_file"] = gr.update(value=str(csv_path), interactive=True)
        elif files is False:
            out["json_file"] = out["csv_file"] = gr.update(value=None, interactive=False)
        return outputs(RACE_OUTPUTS, **out)

    def run(
        self, prompt, spec, tau, block_size, max_new_tokens, metric, temperature, full_window, with_ar,
        session: Session,
        mode: str = "mars", precision: str | None = None,
        request: gr.Request = None,
    ) -> Iterator[tuple]:
        """Race MARS (or exact / hybrid mode) against AR on one prompt, streaming every forward pass of both.

        Both sides decode with the one model this run holds: the same weights on the same compute path."""
        if not (prompt or "").strip():
            raise error("Type a prompt first, or pick one of the examples.", "Empty prompt", request)
        config = self._config(tau, block_size, max_new_tokens, metric, temperature, full_window, request, mode)
        path = self._path(precision, request)
        owner = request.session_hash if request is not None else None
        with ExitStack() as held:
            lm = self._hold(spec, held, request, path)
            session.tau.set(config.tau)
            try:  # a prompt longer than the model's context is refused here (or at the first pass)
                mars = generate(lm, prompt, config, tau=session.tau)
                ar = generate(lm, prompt, config.with_(mode="ar")) if with_ar else None
            except ValueError as err:
                raise _prompt_error(err, request) from None
            trace = RaceTrace(prompt=prompt, model=lm.name, config=config, with_ar=bool(with_ar),
                              compute=lm.compute.summary() if lm.compute is not None else "")
            session.trace = trace
            try:
                yield self._outputs(trace, ("mars", "ar"), True, False, session)
                self._settle()  # else the browser draws this first view during MARS's prefill, off AR's clock
                yield from self._race(trace, interleave(mars, ar), session, request)
                if trace.status == "done":
                    yield self._outputs(trace, ("mars", "ar"), True, True, session, owner)
            finally:
                trace.ended.set()  # also when Gradio cancels and closes this generator
                for decoder in (mars, ar):  # their KV caches go now, not when Gradio drops this generator
                    if decoder is not None:
                        decoder.close()
                trim_heap()  # and the freed pages back to the system (engine/memory.py)

    def _race(self, trace: RaceTrace, passes: Iterator, session: Session, request) -> Iterator[tuple]:
        """Decode pass by pass into ``trace``; a view (the panes that changed, the charts when due) when
        ``LaneCadence`` says, so that the UI's work costs both sides the same share."""
        cadence, changed, charted = LaneCadence(self.view_every), set(), time.monotonic()
        while trace.status == "running":
            try:
                side, event = next(passes)  # one forward pass, of one side
            except StopIteration:
                trace.status = "done"
                break
            except ValueError as err:
                trace.status = "error"
                raise _prompt_error(err, request) from None
            if trace.status != "running":
                break  # Stop came during this pass: its handler shows what was decoded
            trace.add(side, event)
            changed.add(side)
            if not cadence.after(side, event.seconds, upcoming_side(trace, side)):
                continue
            due = time.monotonic() - charted >= self.chart_every
            if due:
                charted = time.monotonic()
            yield self._outputs(trace, tuple(sorted(changed)), due, None, session)
            changed.clear()
            self._settle()

    def _settle(self) -> None:
        """Wait, off both clocks, while Gradio sends the view just yielded and the browser draws it."""
        if self.view_settle > 0:
            time.sleep(self.view_settle)

    def stop(self, session: Session, request: gr.Request = None) -> tuple:
        """Stop's own handler; ``cancels=`` ends the run generator at its next pass.

        It waits until the generator has ended, so that no pass decoded before the stop
        can arrive after this final view, then shows and saves what was decoded.
        """
        trace = session.trace
        if trace is None or trace.status != "running":
            return outputs(RACE_OUTPUTS)
        trace.status = "stopped"
        trace.ended.wait(timeout=self.stop_wait)
        return self._outputs(trace, ("mars", "ar"), True, True, session, request.session_hash if request else None)

    # -- the sweep -------------------------------------------------------------------------
    def sweep(
        self, prompts, taus, max_new_tokens, spec, block_size, metric, temperature, full_window=False,
        precision: str | None = None, request: gr.Request = None, progress=gr.Progress(),
    ) -> Iterator[tuple]:
        """Run the chosen prompts at each tau (and 1.0, and AR).

        Yields after every run, and the frontier after every prompt.
        """
        prompts = list(prompts or [])
        try:
            runs_planned = plan(prompts, [float(t) for t in taus or []])
        except ValueError as err:
            raise error(sentence(str(err)), "Nothing to sweep", request) from None
        config = self._config(1.0, block_size, max_new_tokens, metric, temperature, full_window, request)
        path = self._path(precision, request)
        with ExitStack() as held:
            yield from self._sweep(prompts, taus, config, runs_planned, self._hold(spec, held, request, path), progress)
        trim_heap()

    def _sweep(self, prompts, taus, config, runs_planned, lm, progress) -> Iterator[tuple]:
        runs = []
        progress((0, len(runs_planned)), desc=_sweep_desc(runs_planned, 0, prompts))
        for i, run in enumerate(sweep_runs(lm, prompts, [float(t) for t in taus], config)):
            runs.append(run)
            progress((i + 1, len(runs_planned)), desc=_sweep_desc(runs_planned, i + 1, prompts))
            prompt_done = i + 1 == len(runs_planned) or runs_planned[i + 1][0] != run.prompt
            done = prompts.index(run.prompt) + int(prompt_done)
            note = "Sweep finished" if i + 1 == len(runs_planned) else "Sweeping"
            text = f"{note}: {done} of {len(prompts)} prompts, {i + 1} of {len(runs_planned)} runs."
            status = f'<div class="sweep-status">{escape(text)}</div>'
            if prompt_done:  # redraw the frontier with this prompt in it
                points = frontier(runs)
                yield outputs(SWEEP_OUTPUTS, sweep_status=status, sweep_plot=charts.frontier(points),
                              sweep_table=_sweep_table(points))
            else:  # a yield per run, so the sweep's Stop takes effect between runs
                yield outputs(SWEEP_OUTPUTS, sweep_status=status)


def _prompt_error(err: ValueError, request: gr.Request | None) -> gr.Error:
    return error(sentence(f"Cannot decode this prompt: {err}"), "Prompt not accepted", request)


def _side_status(trace: RaceTrace, side: str) -> str:
    return "done" if trace.finish_reason(side) else trace.status


def _sweep_desc(planned: list, i: int, prompts: list[str]) -> str:
    if i >= len(planned):
        return "done"
    prompt, mode, tau = planned[i]
    which = f"prompt {prompts.index(prompt) + 1}/{len(prompts)}"
    return f"{which}: {'AR baseline' if mode == 'ar' else f'MARS tau {tau:g}'}"


def _sweep_table(points) -> list[list]:
    return [
        [
            p.tau, p.prompts, round(p.tokens_per_forward, 3), round(p.tokens_per_second, 1),
            None if p.speedup is None else round(p.speedup, 3), round(p.agreement, 3), round(p.exact, 3),
        ]
        for p in points
    ]
