"""Native kernels (``csrc/*.cpp``), compiled on first use with this machine's C++ compiler.

A kernel's library is built once (g++, or the compiler named by ``CXX``; -O3, tuned to this CPU,
OpenMP, no fast-math, int8_linear without fused multiply-adds) into the cache beside the
converted weights, keyed by the source, the compiler, the CPU and its instruction sets, and loaded
with ctypes. ``library`` returns None where there is no compiler or the build fails (a warning):
every caller has a torch path that gives the same results (``int8_linear``: the same bits;
``row_attention``: the same up to float rounding). Which one a process uses never changes while it
runs, so all of its passes round alike.

A struct handed to a kernel through ctypes is checked, not trusted: the library exports each
struct's layout (``layout_<Struct>``: its size, then every field's offset and size in order) and
``function`` compares it with the ctypes class at load. A mismatch refuses that kernel with one
logged error (its torch path runs) instead of letting the kernel read memory at the wrong offsets.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from functools import cache
from pathlib import Path

from .... import settings
from ...machine import cache_dir, cpu_features, cpu_model

logger = logging.getLogger(__name__)

SOURCES = Path(__file__).resolve().parent / "csrc"
FLAGS = ("-O3", "-fPIC", "-shared", "-pthread", "-std=c++17")
# int8_linear: a * b + c stays two roundings, as torch's ops round it (g++ fuses them otherwise)
OWN_FLAGS = {"int8_linear": ("-ffp-contract=off",), "decoder": ("-ffp-contract=off",)}
# A kernel whose source a bigger library includes, built with the same flags, is taken from that library:
# the same code, one build fewer on a first start (decoder.cpp includes int8_linear.cpp).
INCLUDED_IN = {"int8_linear": "decoder", "padding_ranges": "row_attention", "mask_ranges": "row_attention"}
assert all(OWN_FLAGS.get(name) == OWN_FLAGS.get(big) for name, big in INCLUDED_IN.items())
TUNE = ("-march=native",)  # dropped where the compiler refuses it
# OpenMP for the kernels' threads. The library asks for libgomp.so.1, and the dynamic linker hands it
# the one torch has loaded (same soname): the kernels share torch's threads instead of competing
# with them. Dropped where the compiler has no OpenMP (the kernels then run on one thread).
OPENMP = ("-fopenmp",)


def compiler() -> str | None:
    return shutil.which(settings.CXX.read()) or shutil.which("c++") or shutil.which("clang++")


def build(name: str, compiler: str, where: Path) -> Path:
    """The shared library of ``csrc/<name>.cpp`` for this compiler and CPU: built once, then found in ``where``."""
    source = SOURCES / f"{name}.cpp"
    own = OWN_FLAGS.get(name, ())
    version = subprocess.run([compiler, "--version"], check=False, capture_output=True, text=True, timeout=30).stdout
    key = [*_texts(source), version, cpu_model(), cpu_features(), platform.machine(), *FLAGS, *own, *TUNE, *OPENMP]
    digest = hashlib.sha256("\0".join(key).encode()).hexdigest()[:16]
    target = where / f"{name}-{digest}.so"
    if target.exists():
        return target
    where.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=where) as scratch:
        built = Path(scratch) / target.name
        for extra in ((*TUNE, *OPENMP), TUNE, ()):
            command = [compiler, *FLAGS, *own, *extra, "-o", str(built), str(source)]
            done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)
            if done.returncode == 0:
                break
        else:
            raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "compiler failed")
        os.replace(built, target)  # atomic: a process beside this one sees the whole file or none
    return target


def _texts(source: Path) -> list[str]:
    """The source's text and those of the csrc files it includes (decoder.cpp includes the other kernels)."""
    text = source.read_text()
    included = re.findall(r'^#include "([^"]+)"', text, flags=re.MULTILINE)
    return [text, *(part for name in included for part in _texts(SOURCES / name))]


_building: dict[str, threading.Thread] = {}  # prebuild's builds, by kernel name


def prebuild(names: tuple[str, ...]) -> None:
    """Build these kernels' libraries in background threads (one compiler each), unless already started.

    Nothing is loaded: ``library`` waits for a name's build and then finds the file (or builds again and
    says why it failed). A first start overlaps the compiler with other work this way.
    """
    found = compiler()
    if found is None:
        return
    for name in names:
        if name not in _building:
            thread = threading.Thread(target=_build_quietly, args=(name, found, cache_dir() / "native"), daemon=True)
            _building[name] = thread
            thread.start()


def _build_quietly(name: str, found: str, where: Path) -> None:
    try:
        build(name, found, where)
    except (OSError, RuntimeError, subprocess.SubprocessError):
        pass  # library() builds again and logs the reason


@cache
def library(name: str) -> ctypes.CDLL | None:
    """The loaded library of ``csrc/<name>.cpp``, or None: no compiler, or the build failed."""
    if name in _building:
        _building[name].join()
    found = compiler()
    if found is None:
        logger.info("no C++ compiler: the native %s kernel is not used", name)
        return None
    try:
        return ctypes.CDLL(str(build(name, found, cache_dir() / "native")))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        logger.warning("native %s kernel unavailable (%s): its torch path runs instead", name, error)
        return None


def function(
    name: str, switch: str, argtypes: list, structs: dict[str, type[ctypes.Structure]] | None = None,
) -> ctypes._CFuncPtr | None:
    """The C function ``name`` of ``csrc/<name>.cpp`` (returning int), or None: ``switch`` set to "0", no library,
    or a struct it takes laid out differently in C.

    structs: the ctypes class of each C struct the function reads, by the struct's name in the source.
    """
    if not settings.read(switch):
        return None
    loaded = library(INCLUDED_IN.get(name, name)) or library(name)
    if loaded is None:
        return None
    for struct_name, struct in (structs or {}).items():
        wrong = layout_mismatch(loaded, struct_name, struct)
        if wrong is not None:
            logger.error("native %s kernel refused, its torch path runs instead: %s", name, wrong)
            return None
    found = getattr(loaded, name)
    found.argtypes = argtypes
    found.restype = ctypes.c_int
    return found


def layout(struct: type[ctypes.Structure]) -> list[int]:
    """A ctypes class's layout as ``layout_<Struct>`` writes it: size, field count, (offset, size) per field."""
    fields = [getattr(struct, field[0]) for field in struct._fields_]
    return [ctypes.sizeof(struct), len(fields), *(n for f in fields for n in (f.offset, f.size))]


def exported_layout(loaded: ctypes.CDLL, struct_name: str) -> list[int] | None:
    """The layout of C struct ``struct_name`` that the library exports, or None where it exports none."""
    try:
        exporter = getattr(loaded, f"layout_{struct_name}")
    except AttributeError:
        return None
    exporter.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int64]
    exporter.restype = ctypes.c_int64
    entries = exporter(None, 0)
    out = (ctypes.c_int64 * entries)()
    exporter(out, entries)
    return list(out)


def layout_mismatch(loaded: ctypes.CDLL, struct_name: str, struct: type[ctypes.Structure]) -> str | None:
    """How ``struct`` differs from the library's C struct ``struct_name``, in one sentence; None where they agree.

    The first field out of place is named; two fields of one size swapped keep the layout and pass.
    """
    theirs, ours = exported_layout(loaded, struct_name), layout(struct)
    where = f"ctypes class {struct.__name__} and C struct {struct_name}"
    if theirs is None:
        return f"the library exports no layout for C struct {struct_name}"
    for i, (field, *_) in enumerate(struct._fields_[: theirs[1]]):
        mine, c_side = ours[2 + 2 * i: 4 + 2 * i], theirs[2 + 2 * i: 4 + 2 * i]
        if mine != c_side:
            return (
                f"{where} differ at field {i} ({field!r}): offset {mine[0]}, size {mine[1]} in Python; "
                f"offset {c_side[0]}, size {c_side[1]} in C"
            )
    if theirs[:2] != ours[:2]:
        sizes = (f"{size} bytes in {count} fields" for size, count in (ours[:2], theirs[:2]))
        return f"{where} differ: {next(sizes)} in Python, {next(sizes)} in C"
    return None
