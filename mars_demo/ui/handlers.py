"""The app's event handlers: they turn engine events into component values, and nothing more.

The run handler is a generator that decodes as Gradio pulls from it: MARS and AR
passes alternate (``race.interleave``), one yield per pass. A yield carries the panes that
changed when ``race.LaneCadence`` says a view is due (``view_every``: a side's own decoding
seconds between views; 0, the default here, every pass; the app uses ``race.VIEW_EVERY`` and
waits ``view_settle`` after each view, off both clocks), else nothing to draw: Gradio closes a
cancelled generator at its next yield, so a cancel ends the work within one pass. No helper
thread, no replay. Stop cancels the run (``cancels=``) and marks its trace stopped; its handler
waits for the generator's end before it shows the final view. ``set_tau`` (the slider's change
event, never queued behind a run) writes the session's LiveTau, read before every pass.

Every race, sweep and Serving run holds the decoding slot (``hosting.DecodeSlot``) until its work has
ended, and ends at the host's time budget (``hosting.Limits``) with what it decoded. Toasts are built
in ``messages.py``. Models go through the hosting policy and are held by a run while it decodes
(``models.py``), keyed by checkpoint and CPU compute path (the sidebar's setting, checked like
``--precision``; ignored on a GPU). Trace files live in a bounded ``TraceStore``. The handlers
object reaches the model, so nothing in the component config may reach it.
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

from ..engine.backends.cpu.paths import check_precision
from ..engine.checkpoints.hub import HubUnreachable, check_hub
from ..engine.checkpoints.loading import load_for_decoding
from ..engine.checkpoints.memory import ModelTooLarge, check_fits, trim_heap
from ..engine.decoding.chat import prompt_ids
from ..engine.decoding.config import METRICS, MODES, RANGES, VERIFYING_MODES, DecodeConfig
from ..engine.decoding.loop import StepEvent, generate
from ..engine.decoding.scoring import teacher_forced
from . import charts
from .hosting import DecodeSlot, Limits, SlotBusy
from .loading import staged_load
from .messages import error, number, sentence, text, warning
from .models import (
    COMPUTE_CHOICES,
    Loader,
    ModelBusy,
    ModelCache,
    ModelPolicy,
    ModelRefused,
    bundled_note,
    default_compute_path,
)
from .outputs import MODEL_OUTPUTS, RACE_OUTPUTS, SWEEP_OUTPUTS, outputs
from .race import LaneCadence, RaceTrace, Session, interleave, lanes, upcoming_side
from .render import ar_pane, mars_pane, model_message, model_status
from .sweep import SweepRun, frontier, plan, sweep_choices, sweep_desc, sweep_passes, sweep_table
from .traces import TraceStore, stem
from .tree_setting import check_tree
from .zerogpu import on_zero_gpu

logger = logging.getLogger(__name__)

BUSY = ("Another model is in use by other visitors' runs right now: "
        "try again once they finish, or keep the model that is loaded.")
SHARED_PATH = ("This server decodes every run on the compute path the shared model was loaded on ({default}), "
               "so that no visitor's choice reloads it for everyone: keep {default}")
MAX_PROMPT_CHARS = 8000  # a race's prompt; the model's context refuses a long one anyway, with a message


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
        limits: Limits | None = None,
        slot: DecodeSlot | None = None,
    ) -> None:
        # guard: refuses a model that would not fit in memory; check_hub: a hub id fails at once without the hub
        self.models = ModelCache(loader, capacity, guard, check_hub)
        self.limits = limits or Limits()  # the host's limits (hosting.py): budget, tokens, sweep size, paths
        self.slot = slot or DecodeSlot()  # held by every race, sweep and serving run until its work has ended
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
        if isinstance(err, (ModelTooLarge, HubUnreachable)) and (spec or "").strip() in self.policy.specs:
            return str(err)  # a size, or the hub out of reach; a typed spec gets the one refusal below
        if not isinstance(err, ModelRefused):
            logger.warning("cannot load %r: %s", spec, err)
        return self.policy.refusal

    def compute_path(self, precision: str | None) -> str | None:
        """The sidebar's compute path as the model cache's key: checked as ``--precision`` is (a ValueError
        with one line), None (the default) is MARS_DEMO_PRECISION or auto, and on a GPU it is None: ignored."""
        default = default_compute_path()[0]
        if precision is not None and not isinstance(precision, str):
            raise TypeError("the compute path must be one of " + ", ".join(COMPUTE_CHOICES))
        precision = check_precision(default if precision is None else precision)
        if self.on_gpu:
            return None
        if self.limits.paths == "shared" and precision not in self.models.paths(default):
            raise ValueError(SHARED_PATH.format(default=default))
        return precision

    def _path(self, precision: str | None, request: gr.Request | None) -> str | None:
        try:
            return self.compute_path(precision)
        except (TypeError, ValueError) as err:
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
        except (TypeError, ValueError) as err:
            yield self._kept(sentence(str(err)), session, "Bad setting", request, session.spec)
            return
        try:
            spec = self.policy.check(spec)
            for lm in staged_load(self.models, spec, path):  # what the load is doing, then the model
                if isinstance(lm, str):
                    yield outputs(MODEL_OUTPUTS, model_line=model_message(lm))
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
    def set_tau(self, value: float, session: Session, request: gr.Request = None) -> None:
        """The slider's change event: the running decoder reads the new tau before its next pass."""
        try:
            session.tau.set(number(value, "tau", *RANGES["tau"][:2]))
        except (TypeError, ValueError) as err:
            raise error(sentence(str(err)), "Bad setting", request) from None

    # -- the race --------------------------------------------------------------------------
    def _config(
        self, tau, block_size, max_new_tokens, metric, temperature, full_window=False, request=None, mode="mars",
        most_tokens: int | None = None, top_p=1.0, top_k=0, tree=None,
    ) -> DecodeConfig:
        """The run's DecodeConfig; ``most_tokens``: this server's cap on max new tokens (Limits); ``tree``: the
        candidate-tree setting, read (and checked) in exact and hybrid modes only (tree_setting.py)."""
        most = most_tokens or self.limits.max_new_tokens
        try:
            for value, choices, label in ((metric, METRICS, "metric"), (mode, MODES, "mode")):
                if value not in choices:  # the value itself is never echoed: it may be huge, or markup
                    raise ValueError(f"{label} must be one of {', '.join(choices)}")
            if not isinstance(full_window, (bool, type(None))):
                raise TypeError("full window must be true or false")
            return DecodeConfig(
                mode=mode, tau=number(tau, "tau", *RANGES["tau"][:2]),
                block_size=number(block_size, "Block size", *RANGES["block_size"][:2], integer=True),
                max_new_tokens=number(max_new_tokens, "Max new tokens", 1, most, integer=True),
                metric=metric, temperature=number(temperature, "Temperature", *RANGES["temperature"][:2]),
                max_fed=None if full_window else "auto", top_p=number(top_p, "Top-p", 0, 1),
                top_k=number(top_k, "Top-k", *RANGES["top_k"][:2], integer=True),
                tree=check_tree(tree) if mode in VERIFYING_MODES else None,
            )
        except (TypeError, ValueError) as err:
            raise error(sentence(str(err)), "Bad setting", request) from None

    def _slot(self, stack: ExitStack, request: gr.Request | None):
        """The decoding slot for this run until ``stack`` closes; its cancel flag (a closed tab sets it)."""
        try:
            return stack.enter_context(self.slot.hold(request.session_hash if request is not None else None))
        except SlotBusy as err:
            raise error(str(err), "Busy", request) from None

    def _outputs(self, trace: RaceTrace, panes: tuple[str, ...], charts_due: bool, files: bool | None, session: Session,
                 owner: str | None = None) -> tuple:
        """RACE_OUTPUTS: both panes, five figures (the tree shapes' shown in exact and hybrid modes only), the JSON
        and CSV download buttons.

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
                "summary_plot": charts.summary_table(mars, ar, trace.nll if trace.sampled else None, trace.config.tree),
                "tree_plot": gr.update(value=charts.tree_shapes(mars, trace.config.tree), visible=trace.verifying),
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
        mode: str = "mars", precision: str | None = None, top_p=1.0, top_k=0, tree=None,
        request: gr.Request = None,
    ) -> Iterator[tuple]:
        """Race MARS (or exact / hybrid mode) against AR on one prompt, streaming every forward pass of both.

        Both sides decode with the one model this run holds: the same weights on the same compute path.
        Sampled, each side draws from its own seed (race.lanes) and is scored under the model at the end.
        The run holds the decoding slot until it ends, yields once per pass (so a cancel ends it before
        the next one) and ends at the time budget with what it decoded (status "limit")."""
        try:
            prompt = text(prompt, "The prompt", MAX_PROMPT_CHARS)
        except (TypeError, ValueError) as err:
            raise error(sentence(str(err)), "Prompt not accepted", request) from None
        if not prompt.strip():
            raise error("Type a prompt first, or pick one of the examples.", "Empty prompt", request)
        config = self._config(tau, block_size, max_new_tokens, metric, temperature, full_window, request, mode,
                              top_p=top_p, top_k=top_k, tree=tree)
        config, ar_config = lanes(config)
        path = self._path(precision, request)
        owner = request.session_hash if request is not None else None
        with ExitStack() as held:
            cancel = self._slot(held, request)
            lm = self._hold(spec, held, request, path)
            session.tau.set(config.tau)
            try:  # a prompt longer than the model's context is refused here (or at the first pass)
                mars = generate(lm, prompt, config, tau=session.tau)
                ar = generate(lm, prompt, ar_config) if with_ar else None
            except ValueError as err:
                raise _prompt_error(err, request) from None
            trace = RaceTrace(prompt=prompt, model=lm.name, config=config, with_ar=bool(with_ar),
                              compute=lm.compute.summary() if lm.compute is not None else "", ar_seed=ar_config.seed)
            session.trace = trace
            deadline = time.monotonic() + self.limits.run_seconds
            try:
                yield self._outputs(trace, ("mars", "ar"), True, False, session)
                self._settle()  # else the browser draws this first view during MARS's prefill, off AR's clock
                yield from self._race(trace, interleave(mars, ar), session, request, cancel, deadline)
                if trace.status == "limit":
                    warning(self.limits.over_budget("run"), "Time limit", request)
                if trace.status in ("done", "limit"):
                    _score(trace, lm)
                    yield self._outputs(trace, ("mars", "ar"), True, True, session, owner)
            finally:
                for decoder in (mars, ar):  # their KV caches go now, not when Gradio drops this generator
                    if decoder is not None:
                        decoder.close()
                if not trace.nll:
                    _score(trace, lm)  # a stopped run: before Stop's final view, which waits for the end
                trace.ended.set()  # also when Gradio cancels and closes this generator
                trim_heap()  # and the freed pages back to the system (engine/checkpoints/memory.py)

    def _race(self, trace: RaceTrace, passes: Iterator, session: Session, request, cancel, deadline: float
              ) -> Iterator[tuple]:
        """Decode pass by pass into ``trace``; a view (the panes that changed, the charts when due) when
        ``LaneCadence`` says, so that the UI's work costs both sides the same share, else a yield that
        carries nothing to draw: Gradio closes a cancelled run there, before its next pass."""
        cadence, changed, charted = LaneCadence(self.view_every), set(), time.monotonic()
        while trace.status == "running":
            if cancel.is_set():  # a closed tab
                trace.status = "stopped"
                break
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
            if time.monotonic() >= deadline and upcoming_side(trace, side) is not None:
                trace.status = "limit"
                break
            if not cadence.after(side, event.seconds, upcoming_side(trace, side)):
                yield outputs(RACE_OUTPUTS)
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
        precision: str | None = None, top_p=1.0, top_k=0, request: gr.Request = None, progress=gr.Progress(),
    ) -> Iterator[tuple]:
        """Run the chosen prompts at each tau (and 1.0, and AR).

        Yields after every pass (a cancel ends the sweep before the next one), a status after every run,
        and the frontier after every prompt; the time budget ends it with the frontier of the runs done.
        """
        try:
            prompts, taus = sweep_choices(prompts, taus)
            runs_planned = plan(prompts, taus)
        except (TypeError, ValueError) as err:
            raise error(sentence(str(err)), "Nothing to sweep", request) from None
        if len(runs_planned) > self.limits.sweep_runs:
            raise error(f"This sweep plans {len(runs_planned)} runs; this server runs at most "
                        f"{self.limits.sweep_runs} per sweep: choose fewer prompts or tau values.", "Sweep too large",
                        request)
        config = self._config(1.0, block_size, max_new_tokens, metric, temperature, full_window, request,
                              most_tokens=self.limits.sweep_tokens, top_p=top_p, top_k=top_k)
        path = self._path(precision, request)
        try:
            with ExitStack() as held:
                cancel = self._slot(held, request)
                lm = self._hold(spec, held, request, path)
                yield from self._sweep(prompts, taus, config, runs_planned, lm, progress, cancel, request)
        finally:
            trim_heap()

    def _sweep(self, prompts, taus, config, runs_planned, lm, progress, cancel, request) -> Iterator[tuple]:
        runs, deadline = [], time.monotonic() + self.limits.run_seconds
        progress((0, len(runs_planned)), desc=sweep_desc(runs_planned, 0, prompts))
        passes = sweep_passes(lm, prompts, taus, config)
        try:
            for item in passes:
                if isinstance(item, StepEvent):
                    if cancel.is_set():  # a closed tab
                        return
                    if time.monotonic() >= deadline:
                        warning(self.limits.over_budget("sweep"), "Time limit", request)
                        yield self._sweep_view("Time limit reached", runs, runs_planned, prompts, True)
                        return
                    yield outputs(SWEEP_OUTPUTS)  # nothing to draw: a cancelled sweep ends here, before its next pass
                    continue
                runs.append(item)
                i = len(runs)
                progress((i, len(runs_planned)), desc=sweep_desc(runs_planned, i, prompts))
                prompt_done = i == len(runs_planned) or runs_planned[i][0] != item.prompt
                note = "Sweep finished" if i == len(runs_planned) else "Sweeping"
                yield self._sweep_view(note, runs, runs_planned, prompts, prompt_done)  # the frontier after a prompt
        finally:
            passes.close()  # the run under way and its KV cache end now

    @staticmethod
    def _sweep_view(note: str, runs: list[SweepRun], planned: list, prompts: list[str], redraw: bool) -> tuple:
        done = sum(1 for p in prompts if sum(r[0] == p for r in planned) == sum(r.prompt == p for r in runs))
        line = f"{note}: {done} of {len(prompts)} prompts, {len(runs)} of {len(planned)} runs."
        status = f'<div class="sweep-status">{escape(line)}</div>'
        if not redraw:
            return outputs(SWEEP_OUTPUTS, sweep_status=status)
        points = frontier(runs)
        return outputs(SWEEP_OUTPUTS, sweep_status=status, sweep_plot=charts.frontier(points),
                       sweep_table=sweep_table(points))


def _score(trace: RaceTrace, lm) -> None:
    """A sampled race's NLL per token of each side under the model (one teacher-forced pass a side); a side
    with no tokens, or a failure (logged), leaves its entry out, and the summary shows a dash."""
    if not trace.sampled:
        return
    try:
        ids = prompt_ids(lm.tokenizer, trace.prompt)
        for side in ("mars", "ar"):
            tokens = [t for s in trace.steps(side) or [] for t in s.token_ids]
            if tokens:
                scored = teacher_forced(lm.backend, ids, tokens)
                trace.nll[side] = scored.total / scored.tokens
    except Exception as err:  # noqa: BLE001 - a figure the summary can do without, never the run's failure
        logger.warning("cannot score the race: %s", err)


def _prompt_error(err: ValueError, request: gr.Request | None) -> gr.Error:
    return error(sentence(f"Cannot decode this prompt: {err}"), "Prompt not accepted", request)


def _side_status(trace: RaceTrace, side: str) -> str:
    return "done" if trace.finish_reason(side) else trace.status
