"""Will a model fit in memory? Its size from metadata, checked before anything is loaded.

The app calls ``check_fits(spec)`` before it loads a model, so that a visitor picking a
released 7B checkpoint on a small CPU host gets one clear message instead of running the
server out of memory. The parameter count comes from metadata only, never from loading:

* the bundled model: the header of its converted weights (or SmolLM2-135M's known count);
* a local folder: the headers of its ``*.safetensors`` files (``safetensors.safe_open``
  reads the header, not the tensors), else the size of its weight files; an adapter
  folder counts its base;
* a hub id: ``huggingface_hub.get_safetensors_metadata`` (the headers, fetched by range
  request), else a copy in the local hub cache, else, for the released checkpoints, the
  size in their name.

Memory a CPU load takes: parameters x 4 bytes (fp32) x the load factor of its compute path
(``LOAD_FACTORS``: the weights are read in fp32 and converted, and ``auto`` measures converted
copies the first time; an unknown path counts the largest). Free memory: the
lower of ``MemAvailable`` (/proc/meminfo; ``os.sysconf`` where there is none) and the
room left under the cgroup's memory limit (a container, a Space). A model is refused
when it needs more than the free memory less ``MARS_DEMO_MEMORY_MARGIN_MB`` (default
1024). A size that cannot be told (no metadata) is not refused: the loader decides.
The check is for CPU loads; a GPU load is not checked here.

``trim_heap`` hands the C heap's free pages back to the system after a run (glibc's
``malloc_trim``): forward passes on several worker threads leave freed tensors' pages in
glibc's arenas, which RSS counts although nothing uses them (docs/soak.md, "Memory growth").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import os
import re
import threading
import time
from pathlib import Path

from ... import settings
from .loading import BUNDLED, BUNDLED_BASE, RELEASED, ModelLoadError, cache_dir

logger = logging.getLogger(__name__)

BYTES_PER_PARAM = 4  # fp32: what load_model uses on a CPU
# Peak RSS a CPU load adds per fp32 byte of weights, by compute path, rounded up: the bundled model
# (134.5M parameters, 538 MB in fp32) loaded by load_for_decoding and decoding 16 tokens added 582 MB
# (fp32), 804 (bf16), 767 (int8), 1085 (int8dyn: fp32 weights, smoothing pass and fbgemm's packing),
# and 1313 for "auto" on a machine it had not measured (it converts a copy of the model for each
# path); docs/bench/history.md, "Memory by compute path".
LOAD_FACTORS = {"fp32": 1.1, "bf16": 1.5, "int8": 1.5, "int8dyn": 2.1, "auto": 2.5}
LOAD_FACTOR = max(LOAD_FACTORS.values())  # a path that cannot be told
SMOLLM2_135M_PARAMS = 134_515_008  # the bundled base (header of its converted weights)
MARGIN_ENV = settings.MEMORY_MARGIN_MB.name
WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".gguf")
GB = 2**30


class ModelTooLarge(ModelLoadError):
    """A model that would not fit in the memory left; the message says how much it needs, never how much the
    host has free (a visitor reads it; the server log has both)."""

    def __init__(self, needed: int, available: int) -> None:
        self.needed, self.available = needed, available
        super().__init__(
            f"That model needs about {needed / GB:.1f} GB of memory, more than this server can spare, "
            "so it is not loaded: pick a smaller one."
        )


# -- free memory -------------------------------------------------------------------------------
def _meminfo_available(path: Path) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _cgroup_room(root: Path) -> int | None:
    """Bytes left under this process's cgroup memory limit (v2, else v1); None without a limit."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        limit, usage = _read_int(root / limit_file), _read_int(root / usage_file)
        if limit is not None and usage is not None and limit < 2**60:  # v1 writes a huge number for "none"
            return limit - usage
    return None


def available_bytes(meminfo: str | Path = "/proc/meminfo", cgroup: str | Path = "/sys/fs/cgroup") -> int | None:
    """Memory this process can still take: the lower of MemAvailable and the cgroup's room (None: unknown)."""
    known = [b for b in (_meminfo_available(Path(meminfo)), _cgroup_room(Path(cgroup))) if b is not None]
    return min(known) if known else None


# -- model size ----------------------------------------------------------------------------------
def _safetensors_params(files: list[Path]) -> int:
    from safetensors import safe_open

    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118 - safe_open is no dict
    return total


def _folder_params(folder: Path, depth: int = 0) -> int | None:
    adapter = folder / "adapter_config.json"
    if adapter.is_file() and depth == 0:  # a LoRA adapter: what matters is its base
        import json

        try:
            base = json.loads(adapter.read_text()).get("base_model_name_or_path") or BUNDLED_BASE
        except (OSError, ValueError):
            return None
        return parameter_count(base, _depth=1)
    shards = sorted(folder.glob("*.safetensors"))
    if shards:
        return _safetensors_params(shards)
    weights = [p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()]
    # stored precision unknown: count 2 bytes a parameter (an fp32 file then counts double: the safe side)
    return sum(p.stat().st_size for p in weights) // 2 if weights else None


def _hub_params(repo: str) -> int | None:
    from huggingface_hub import get_safetensors_metadata, snapshot_download

    try:
        return sum(get_safetensors_metadata(repo).parameter_count.values())
    except Exception as err:  # noqa: BLE001 - offline, no such repo, not safetensors: try the local cache
        logger.info("no safetensors metadata for %s from the hub (%s)", repo, type(err).__name__)
    try:
        return _folder_params(Path(snapshot_download(repo, local_files_only=True)), depth=1)
    except Exception:  # noqa: BLE001 - not cached either: size unknown
        return None


def parameter_count(spec: str, _depth: int = 0) -> int | None:
    """The checkpoint's parameter count from metadata (None: cannot tell); loads nothing."""
    if spec in (BUNDLED, BUNDLED_BASE):
        cached = cache_dir() / "smollm2-135m-instruct" / "model.safetensors"
        return _safetensors_params([cached]) if cached.is_file() else SMOLLM2_135M_PARAMS
    try:
        folder = Path(spec)
        if folder.is_dir():
            return _folder_params(folder, _depth)
    except (OSError, ValueError):
        return None
    if re.fullmatch(r"[\w.-]+/[\w.-]+", spec):
        count = _hub_params(spec)
        if count is None and spec in RELEASED:
            count = int(float(re.search(r"-(\d+(?:\.\d+)?)B-", spec).group(1)) * 1e9)
        return count
    return None


def load_factor(precision: str | None = None) -> float:
    """``LOAD_FACTORS`` for ``precision``; None: the loader's default (MARS_DEMO_PRECISION, else auto)."""
    if precision is None:
        precision, _ = settings.PRECISION.read_or_default()  # a bad value: the loader refuses it, with its message
    return LOAD_FACTORS.get(precision, LOAD_FACTOR)


def needed_bytes(params: int, precision: str | None = None) -> int:
    return int(params * BYTES_PER_PARAM * load_factor(precision))


def margin_bytes() -> int:
    """MARS_DEMO_MEMORY_MARGIN_MB in bytes; a value that cannot be read is logged, the default used."""
    mb, problem = settings.MEMORY_MARGIN_MB.read_or_default()
    if problem:
        logger.warning("%s", problem)
    return int(mb * 2**20)


def check_fits(spec: str, available: int | None = None, *, precision: str | None = None) -> None:
    """Raise ``ModelTooLarge`` when ``spec``, loaded on compute path ``precision``, would not fit in the
    free memory less the margin."""
    import torch

    if torch.cuda.is_available():
        return  # weights go to the GPU: not checked here
    params = parameter_count(spec)
    available = available_bytes() if available is None else available
    if params is None or available is None:
        logger.info("cannot tell whether %s fits (parameters %s, free %s): loading it", spec, params, available)
        return
    needed = needed_bytes(params, precision)
    if needed > available - margin_bytes():
        logger.warning("refused %s (%s): needs ~%.1f GB, %.1f GB free, margin %.1f GB", spec, precision or "default",
                       needed / GB, available / GB, margin_bytes() / GB)
        raise ModelTooLarge(needed, available)


# -- freed memory back to the system -----------------------------------------------------------
class _Trim:
    lock = threading.Lock()
    last = float("-inf")
    libc: ctypes.CDLL | None | bool = False  # False: not looked up yet; None: no malloc_trim here


def _malloc_trim():
    if _Trim.libc is False:
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name) if name else None
            _Trim.libc = libc if libc is not None and hasattr(libc, "malloc_trim") else None
        except OSError:
            _Trim.libc = None
    return _Trim.libc.malloc_trim if _Trim.libc else None


def trim_heap(every: float | None = None) -> bool:
    """glibc ``malloc_trim(0)``, at most once per ``every`` seconds (MARS_DEMO_MALLOC_TRIM, default 5; 0: never).

    Returns whether it trimmed; a no-op where the C library has no malloc_trim (musl, macOS).
    """
    if every is None:
        every, problem = settings.MALLOC_TRIM.read_or_default()
        if problem:
            logger.warning("%s", problem)
    trim = _malloc_trim() if every > 0 else None
    if trim is None:
        return False
    with _Trim.lock:
        if time.monotonic() - _Trim.last < every:
            return False
        trim(0)
        _Trim.last = time.monotonic()
    return True
