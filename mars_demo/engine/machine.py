"""Facts of the machine that other modules key their caches by: where caches live, the CPU model."""

from __future__ import annotations

import platform
from pathlib import Path

from .. import settings

ASSETS = Path(__file__).resolve().parents[2] / "assets"  # the repository's assets/: shipped data and model files


def cache_dir() -> Path:
    """Where converted weights, cost tables and built kernels live (``MARS_DEMO_CACHE`` overrides)."""
    return settings.CACHE.read()


def _cpuinfo(field: str) -> str | None:
    """The first ``field`` line of /proc/cpuinfo (Linux), None elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_features() -> str:
    """The instruction sets the CPU reports (a VM may hide some that its model name has)."""
    return _cpuinfo("flags") or _cpuinfo("Features") or platform.machine()
