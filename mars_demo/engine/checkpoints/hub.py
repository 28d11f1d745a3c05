"""Can a hub checkpoint be loaded right now? Answered at once, before anything waits on the network.

A hub id that is not in the local hub cache needs the hub: in offline mode (HF_HUB_OFFLINE) it
cannot load, and without a network huggingface_hub retries for tens of seconds, while the app's
model cache lets one load run at a time. ``check_hub`` refuses such a spec at once with one
message (``HubUnreachable``): offline mode says no without asking; otherwise one short request to
the hub's endpoint (MARS_DEMO_HUB_TIMEOUT seconds, default 3) tells, and its answer is kept for
``REMEMBER`` seconds, so a burst of calls costs one probe. Local paths and the bundled models never
need the hub. The message names no host fact (no path, no address).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from ... import settings
from .loading import BUNDLED, BUNDLED_BASE, ModelLoadError

logger = logging.getLogger(__name__)

REMEMBER = 30.0  # seconds a probe's answer is kept
HUB_DOWN = "The model hub cannot be reached from this server right now, so that model cannot be loaded: " \
           "pick one of the bundled models."


class HubUnreachable(ModelLoadError):
    """The checkpoint needs the hub, and the hub cannot be reached (offline mode, no network)."""


def is_hub_id(spec: str) -> bool:
    """``owner/name`` that is no local path and no bundled model."""
    if spec in (BUNDLED, BUNDLED_BASE) or not re.fullmatch(r"[\w.-]+/[\w.-]+", spec):
        return False
    try:
        return not Path(spec).exists()
    except OSError:
        return True


def offline(env: Mapping[str, str] | None = None) -> bool:
    """huggingface_hub's offline mode (HF_HUB_OFFLINE); ``env``: None, this process's."""
    return settings.HF_HUB_OFFLINE.read(env)


def in_local_cache(spec: str) -> bool:
    """Whether the hub cache holds this repo's config (a load would not need the network for it)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(spec, "config.json"), str)
    except Exception:  # noqa: BLE001 - a malformed id or an unreadable cache: not cached
        return False


def timeout(env: Mapping[str, str] | None = None) -> float:
    """Seconds the probe waits (MARS_DEMO_HUB_TIMEOUT); a value that cannot be read is logged, the default used."""
    seconds, problem = settings.HUB_TIMEOUT.read_or_default(env)
    if problem:
        logger.warning("%s", problem)
    return seconds


def _probe(seconds: float) -> bool:
    """One short request to the hub's endpoint: any HTTP answer means it can be reached."""
    import httpx
    from huggingface_hub import constants

    try:
        httpx.head(constants.ENDPOINT, timeout=seconds, follow_redirects=False)
        return True
    except httpx.HTTPError as err:
        logger.info("the hub did not answer (%s)", type(err).__name__)
        return False


class _Reach:
    lock = threading.Lock()
    checked = float("-inf")
    ok = True


def reachable(probe: Callable[[float], bool] = _probe, env: Mapping[str, str] | None = None) -> bool:
    """Whether the hub answers, probed at most once per ``REMEMBER`` seconds (offline mode: never asked)."""
    if offline(env):
        return False
    with _Reach.lock:
        if time.monotonic() - _Reach.checked >= REMEMBER:
            _Reach.ok, _Reach.checked = probe(timeout(env)), time.monotonic()
        return _Reach.ok


def check_hub(spec: str, probe: Callable[[float], bool] = _probe, env: Mapping[str, str] | None = None) -> None:
    """Raise ``HubUnreachable`` at once for a hub id that needs the hub when the hub cannot be reached."""
    spec = spec.strip()
    if not is_hub_id(spec) or in_local_cache(spec):
        return
    if not reachable(probe, env):
        raise HubUnreachable(HUB_DOWN)
