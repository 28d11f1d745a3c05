"""The native greedy choice (``csrc/greedy.cpp``): argmax and its probability in one call (decoding/acceptance.py)."""

from __future__ import annotations

import ctypes
from functools import cache

from . import native

GREEDY_ENV = "MARS_DEMO_GREEDY"  # "0": softmax, argmax and gather through torch
_I, _P = ctypes.c_int64, ctypes.c_void_p


@cache
def greedy_kernel():
    """The native greedy choice (a ctypes function), or None: switched off, no compiler, or the build failed."""
    return native.function("greedy", GREEDY_ENV, [_P, _I, _I, _I, _P, _P, _I])
