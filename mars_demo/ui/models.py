"""One model in memory, shared by every session of the app.

A small cache keyed by checkpoint spec, behind a lock: sessions asking for the
model that is loaded share it, even while another spec loads; asking for another
spec loads it (one load at a time) and only then drops the oldest, so a load that
fails leaves the previous model serving. Decoding needs no lock: a forward pass does not change the model,
and each generation keeps its own KV cache.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable

from ..loading import BUNDLED, BUNDLED_ADAPTER, BUNDLED_BASE, RELEASED, LoadedModel

logger = logging.getLogger(__name__)

Loader = Callable[[str], LoadedModel]


class ModelCache:
    def __init__(self, loader: Loader, capacity: int = 1) -> None:
        if capacity < 1:
            raise ValueError(f"the model cache holds at least one model, got capacity {capacity}")
        self._loader = loader
        self._capacity = capacity
        self._models: OrderedDict[str, LoadedModel] = OrderedDict()
        self._lock = threading.Lock()  # guards the dict; held for moments only
        self._loading = threading.Lock()  # one load at a time; a cached model is served meanwhile

    def _cached(self, spec: str) -> LoadedModel | None:
        with self._lock:
            if spec in self._models:
                self._models.move_to_end(spec)
                return self._models[spec]
            return None

    def get(self, spec: str) -> LoadedModel:
        """The model for ``spec``, loading it if needed; the loader's error propagates unchanged."""
        spec = spec.strip()
        lm = self._cached(spec)
        if lm is not None:
            return lm
        with self._loading:
            lm = self._cached(spec)  # another session may have loaded it while this one waited
            if lm is not None:
                return lm
            logger.info("loading %s", spec)
            lm = self._loader(spec)
            with self._lock:
                self._models[spec] = lm
                while len(self._models) > self._capacity:
                    dropped, _ = self._models.popitem(last=False)
                    logger.info("dropped %s from memory", dropped)
            return lm

    def loaded(self) -> list[str]:
        with self._lock:
            return list(self._models)


def model_choices(online: bool | None = None) -> list[tuple[str, str]]:
    """(label, spec) for the model picker: the bundled default first, the released checkpoints when online."""
    if online is None:
        online = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("0", "", "false", "no")
    choices = [
        (f"{BUNDLED} · bundled", BUNDLED),
        (f"{BUNDLED_BASE} · base, no adapter", BUNDLED_BASE),
    ]
    if online:
        choices += [(f"{spec} · hub{', large' if '-7B-' in spec else ''}", spec) for spec in RELEASED]
    return choices


def bundled_note(spec: str) -> str:
    """A warning for the status line when the bundled default runs without its adapter."""
    if spec == BUNDLED and not (BUNDLED_ADAPTER / "adapter_config.json").is_file():
        return "The MARS adapter is not bundled yet: this is the plain base model, so expect few tokens per pass."
    return ""
