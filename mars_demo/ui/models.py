"""Which models the app serves, and the models in memory, shared by every session.

``ModelPolicy`` is the hosting rule: a visitor picks one of the known models (the
bundled default, its base, the released checkpoints, and what the operator lists in
MARS_DEMO_EXTRA_MODELS); free text (a local path, any hub id) is accepted only when
the operator turns it on (MARS_DEMO_ANY_MODEL; on by default for a local run, off
on a Space or a server bound beyond localhost). A refused spec is refused before
anything is opened, with one message whatever the spec is. ``decoding_threads`` is the
rule for the CPU: served on this machine alone, the app leaves the visitor's browser a core.

``ModelCache`` keeps at most ``capacity`` models, keyed by (spec, compute path), behind a
lock: the same checkpoint on another CPU path (the sidebar's "Compute path": auto, fp32,
bf16, int8, int8dyn; None on a GPU) is another entry, loaded and converted by ``loader(spec, precision)``.
Sessions asking for a loaded model share it, even while another one loads (one load
at a time). A run holds its model (``hold``) for as long as it decodes; a model in
use is never dropped: loading another spec drops the least recently used idle model,
and when every slot is in use the load is refused (``ModelBusy``) instead. Decoding
needs no lock: a forward pass does not change the model, and each generation keeps
its own KV cache. Before a load, ``guard(spec, precision=...)`` may refuse it (the app's guard
is ``engine.checkpoints.memory.check_fits``: a model that would not fit in the free memory on that
path is never loaded).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .. import settings
from ..engine.backends.cpu.paths import PRECISIONS
from ..engine.checkpoints.loading import BUNDLED, BUNDLED_ADAPTER, BUNDLED_BASE, RELEASED
from ..engine.model import LoadedModel

logger = logging.getLogger(__name__)

Loader = Callable[[str, str | None], LoadedModel]  # (spec, precision) -> model on that compute path
Key = tuple[str, str | None]  # (spec, precision): one entry per checkpoint and compute path


class ModelRefused(ValueError):
    """A spec outside the policy; the message is the same for every spec."""


class ModelBusy(RuntimeError):
    """Every model slot is in use by a run: loading another would drop a model someone is decoding with."""


def decoding_threads(
    env: Mapping[str, str] | None = None, threads: int | None = None, gpu: bool | None = None
) -> tuple[int | None, str]:
    """The torch threads the app decodes on (None: leave torch's count), and why a set value was not used.

    MARS_DEMO_THREADS: a number of threads, or auto (the default). Auto, served only on this machine
    (not ``settings.hosted``) on a CPU: every visitor's browser runs on the same cores, and a
    decoding team on all of them waits at its barriers whenever the browser takes one, a cost per
    pass that flatters the race's side with more tokens a pass; so one core is left to the browser
    (docs/bench/history.md, "Browser race, session 19"). Hosted or with OMP_NUM_THREADS set, torch's
    count (``threads``, default ``torch.get_num_threads()``) stands; on a GPU the load keeps one
    (``placement.settle_gpu_host``). ``env``: None, this process's.
    """
    chosen, note = settings.THREADS.read_or_default(env)
    if chosen is not None:
        return chosen, note
    gpu = torch.cuda.is_available() if gpu is None else gpu
    if settings.hosted(env) or gpu or settings.OMP_NUM_THREADS.read(env):
        return None, note
    threads = threads or torch.get_num_threads()
    return (threads - 1 if threads > 1 else None), note


def model_choices(online: bool | None = None, extra: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(label, spec) for the model picker: the bundled default first, the released checkpoints when online."""
    if online is None:
        online = not settings.HF_HUB_OFFLINE.read()
    choices = [
        (f"{BUNDLED} · bundled", BUNDLED),
        (f"{BUNDLED_BASE} · base, no adapter", BUNDLED_BASE),
    ]
    if online:
        choices += [(f"{spec} · hub{', large' if '-7B-' in spec else ''}", spec) for spec in RELEASED]
    return choices + [(spec, spec) for spec in extra if spec not in {s for _, s in choices}]


@dataclass(frozen=True)
class ModelPolicy:
    """The specs a visitor may load: ``choices`` always, anything else only when ``free``."""

    choices: tuple[tuple[str, str], ...]
    free: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ModelPolicy:
        """MARS_DEMO_EXTRA_MODELS and MARS_DEMO_ANY_MODEL (off by default when hosted); None: this process's."""
        online = not settings.HF_HUB_OFFLINE.read(env)
        return cls(tuple(model_choices(online, settings.EXTRA_MODELS.read(env))), settings.ANY_MODEL.read(env))

    @property
    def specs(self) -> tuple[str, ...]:
        return tuple(spec for _, spec in self.choices)

    @property
    def refusal(self) -> str:
        """The one message for a spec that is refused or fails to load: it says nothing about the spec."""
        if self.free:
            return ("Could not load that model (the server log says why). "
                    "Pick one from the list, or type another local path or hub id.")
        return "This server serves only the models in the list: pick one of them."

    def check(self, spec: str | None) -> str:
        """The normalised spec, or ``ModelRefused``; nothing is opened to decide."""
        spec = (spec or BUNDLED).strip() or BUNDLED
        if spec in self.specs or (self.free and len(spec) <= 512 and "\x00" not in spec):
            return spec
        raise ModelRefused(self.refusal)


def default_compute_path(env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The sidebar's first compute path: MARS_DEMO_PRECISION when it names one, else auto; and, for a
    value that names none, why it was not used. ``env``: None, this process's."""
    return settings.PRECISION.read_or_default(env)


COMPUTE_CHOICES = PRECISIONS  # auto, fp32, bf16, int8, int8dyn


class ModelCache:
    def __init__(self, loader: Loader, capacity: int = 1, guard: Callable[..., None] | None = None,
                 precheck: Callable[[str], None] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"the model cache holds at least one model, got capacity {capacity}")
        self._loader = loader
        self._guard = guard  # raises to refuse a load (checkpoints.memory.check_fits), called before the loader
        # raises at once for a spec that cannot load now (checkpoints.hub.check_hub: the hub is out of reach),
        # before waiting for another session's load
        self._precheck = precheck
        self._capacity = capacity
        self._models: OrderedDict[Key, LoadedModel] = OrderedDict()
        self._users: Counter[Key] = Counter()  # runs decoding with each entry right now
        self._lock = threading.Lock()  # guards the dict and the counts; held for moments only
        self._loading = threading.Lock()  # one load at a time; a cached model is served meanwhile

    def _entry(self, key: Key) -> Key | None:
        """The entry that serves ``key``: itself, or the same spec that auto put on that very path (no reload)."""
        if key in self._models:
            return key
        spec, precision = key
        for (other, path), lm in self._models.items():
            if other == spec and path == "auto" and getattr(lm.compute, "path", None) == precision:
                return other, path
        return None

    def _cached(self, key: Key, use: bool) -> tuple[Key, LoadedModel] | None:
        with self._lock:
            key = self._entry(key)
            if key is None:
                return None
            self._models.move_to_end(key)
            self._users[key] += use
            return key, self._models[key]

    def _idle(self) -> list[Key]:
        return [key for key in self._models if not self._users[key]]  # oldest first

    def get(self, spec: str, precision: str | None = None, *, use: bool = False) -> LoadedModel:
        """The model for ``spec`` on ``precision``'s path, loading it if needed (``use``: one more user; see ``hold``).

        Raises ``ModelBusy`` when the cache is full of models in use; the guard's and the loader's errors propagate.
        """
        return self._get((spec.strip(), precision), use)[1]

    def _get(self, key: Key, use: bool) -> tuple[Key, LoadedModel]:
        found = self._cached(key, use)
        if found is not None:
            return found
        if self._precheck is not None:
            self._precheck(key[0])
        with self._loading:
            found = self._cached(key, use)  # another session may have loaded it while this one waited
            if found is not None:
                return found
            with self._lock:
                if len(self._models) >= self._capacity and not self._idle():
                    raise ModelBusy("every model slot is in use by a run")
            if self._guard is not None:
                self._guard(key[0], precision=key[1])
            logger.info("loading %s (compute path %s)", key[0], key[1] or "default")
            lm = self._loader(*key)
            with self._lock:
                idle = self._idle()
                while len(self._models) >= self._capacity and idle:
                    dropped = idle.pop(0)
                    del self._models[dropped]
                    logger.info("dropped %s (%s) from memory (no run was using it)", *dropped)
                self._models[key] = lm
                self._users[key] += use
            return key, lm

    @contextmanager
    def hold(self, spec: str, precision: str | None = None) -> Iterator[LoadedModel]:
        """The model for ``spec`` on that path, kept in memory until the block ends (a run's whole decoding)."""
        key, lm = self._get((spec.strip(), precision), use=True)
        try:
            yield lm
        finally:
            with self._lock:
                self._users[key] -= 1
                if not self._users[key]:
                    del self._users[key]

    def paths(self, default: str | None) -> set[str | None]:
        """``default`` and the paths that auto chose for the models loaded on ``default`` (no reload for either)."""
        with self._lock:
            return {default} | {lm.compute.path for (_, path), lm in self._models.items()
                                if path == default and getattr(lm, "compute", None) is not None}

    def has(self, spec: str, precision: str | None = None) -> bool:
        with self._lock:
            return self._entry((spec.strip(), precision)) is not None

    def entries(self) -> list[Key]:
        """(spec, precision) of every model in memory, least recently used first."""
        with self._lock:
            return list(self._models)

    def loaded(self) -> list[str]:
        """The specs in memory (on any path), least recently used first."""
        return list(dict.fromkeys(spec for spec, _ in self.entries()))

    def in_use(self) -> dict[str, int]:
        """Runs decoding right now, by spec (all paths together)."""
        counts: Counter[str] = Counter()
        with self._lock:
            for (spec, _), users in self._users.items():
                counts[spec] += users
        return dict(counts)


def bundled_note(spec: str) -> str:
    """A warning for the status line when the bundled default runs without its adapter."""
    if spec == BUNDLED and not (BUNDLED_ADAPTER / "adapter_config.json").is_file():
        return "The MARS adapter is not bundled yet: this is the plain base model, so expect few tokens per pass."
    return ""
