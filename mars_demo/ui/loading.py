"""A model load with its stages on the status line: converting the weights, building kernels, measuring paths.

``staged_load`` runs the model cache's ``get`` in a worker thread that listens to the engine's
``progress`` reports, and yields one status text per stage while it runs, then the model. The
handler turns each text into the status line, so the page says what the first minute is spent on
instead of only "loading". Only the session whose request started the load hears its stages; another
session asking for the same model meanwhile waits on the cache's load lock with the first line.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

from ..engine import progress
from ..engine.model import LoadedModel
from .models import ModelCache

_DONE = object()


def staged_load(cache: ModelCache, spec: str, path: str | None) -> Iterator[str | LoadedModel]:
    """Status texts while ``cache.get(spec, path)`` loads, then the model (at once where it is in memory).

    The load's own error is raised here, in the caller's thread, as ``cache.get`` would raise it.
    """
    if cache.has(spec, path):
        yield cache.get(spec, path)
        return
    stages: queue.SimpleQueue = queue.SimpleQueue()
    result: dict = {}

    def load() -> None:
        try:
            with progress.listening(stages.put):
                result["model"] = cache.get(spec, path)
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread, raised there
            result["error"] = err
        finally:
            stages.put(_DONE)

    started = time.monotonic()
    threading.Thread(target=load, name=f"load {spec}", daemon=True).start()
    yield f"Loading {spec}…"
    while (stage := stages.get()) is not _DONE:
        yield f"Loading {spec}: {stage}… ({time.monotonic() - started:.0f} s)"
    if "error" in result:
        raise result["error"]
    yield result["model"]
