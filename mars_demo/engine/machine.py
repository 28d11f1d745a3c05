"""Facts of the machine that other modules key their caches by: where caches live, the CPU model."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cache_dir() -> Path:
    """Where converted weights, cost tables and built kernels live (``MARS_DEMO_CACHE`` overrides)."""
    root = os.environ.get("MARS_DEMO_CACHE") or Path.home() / ".cache" / "mars_demo"
    return Path(root)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
