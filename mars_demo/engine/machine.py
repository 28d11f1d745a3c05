"""Facts of the machine that other modules key their caches by: where caches live (and how their measurement
tables are written), the CPU model."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

from .. import settings

ASSETS = Path(__file__).resolve().parents[2] / "assets"  # the repository's assets/: shipped data and model files
LOADED = 0.6  # a pass timed again at under this share of its kept cost: other load slowed that measurement
CHECK_ROUNDS = 3  # timed rounds of that pass (after two warm-up rounds): fewer only read slower, never falsely fast
CHECK_CONTEXT = 16  # cached tokens before it: one row's attention over 16 keys or 128 costs about the same


def slowed(kept_ms: float, now_ms: float) -> bool:
    """Whether a kept measurement of a pass (``kept_ms``) was slowed by other load: the same pass, timed again now
    as its fastest of a few rounds, takes less than LOADED of it. The VM's own drift moves a pass by up to a third
    (docs/METHOD.md, "Width"); a second process on the same cores doubles it."""
    return now_ms < LOADED * kept_ms


def cache_dir() -> Path:
    """Where converted weights, cost tables and built kernels live (``MARS_DEMO_CACHE`` overrides)."""
    return settings.CACHE.read()


def save_table(path: Path, table: dict) -> None:
    """Write a table of measurements (key -> record; the compute paths' costs, the cost surfaces) as JSON, atomically:
    a process beside this one reads the old table or the new one, never half. Entries measured for a model loaded
    from a folder that is gone (a test's temporary model, a moved checkpoint: ``model=`` in their key) are dropped,
    since nothing can look them up again, so such runs do not grow the table for good."""
    kept = {key: record for key, record in table.items() if not _folder_gone(key)}
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(path.name + f".tmp{os.getpid()}")
    staging.write_text(json.dumps(kept, indent=1) + "\n")
    staging.replace(path)


def _folder_gone(key: str) -> bool:
    """Whether ``key`` names its model (``model=...``) by an absolute path where nothing is any more."""
    for part in key.split("|"):
        name, _, value = part.partition("=")
        if name == "model" and Path(value).is_absolute() and not Path(value).exists():
            return True
    return False


def _cpuinfo(field: str) -> str | None:
    """The first processor's ``field`` in /proc/cpuinfo (Linux), None elsewhere."""
    return _cpuinfo_fields().get(field)


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def _cpuinfo_fields() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (Linux), by exact name; empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        name, colon, value = line.partition(":")
        if colon:
            fields.setdefault(name.strip(), value.strip())
    return fields


def cpu_identity() -> str:
    """The CPU as measurements on it are keyed: its model name, with its family, model and stepping and a digest of
    its instruction sets where /proc/cpuinfo gives them.

    One model name can be several CPUs (a cloud's VMs all read "AMD EPYC", on Zen 3, Zen 4 and Zen 5 hosts), and a
    pass's cost measured on one does not hold on another.
    """
    fields = _cpuinfo_fields()
    numbers = [f"{name}={fields[name]}" for name in ("cpu family", "model", "stepping") if name in fields]
    digest = hashlib.sha256(cpu_features().encode()).hexdigest()[:8]
    return " ".join([cpu_model(), *numbers, f"features={digest}"])


def cpu_features() -> str:
    """The instruction sets the CPU reports (a VM may hide some that its model name has)."""
    return _cpuinfo("flags") or _cpuinfo("Features") or platform.machine()


def last_level_cache() -> int | None:
    """Bytes of the first processor's largest cache level (Linux sysfs), None where it does not say."""
    sizes = {}
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level, size = int((index / "level").read_text()), cache_bytes((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if size:
            sizes[level] = size
    return sizes[max(sizes)] if sizes else None


def cache_bytes(size: str) -> int | None:
    """A cache's size as sysfs writes it ("32768K", "1M", "512") in bytes; None for anything else."""
    size = size.strip()
    unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:].upper(), 1)
    number = size[:-1] if unit > 1 else size
    return int(number) * unit if number.isdigit() else None
