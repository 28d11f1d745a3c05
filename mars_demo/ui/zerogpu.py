"""Hugging Face ZeroGPU: the decoding handlers under ``spaces.GPU``, the model moved as ZeroGPU expects.

On a ZeroGPU Space (``SPACES_ZERO_GPU`` set) a GPU is attached only while a function
wrapped by ``spaces.GPU`` runs, and that function runs in a forked worker process: its
arguments and every value it yields are pickled across. Models are loaded on the CPU
in the main process and moved with ``.to("cuda")`` there (ZeroGPU records the move and
makes it when a GPU is attached); the app loads the default model at start-up on ZeroGPU.

Elsewhere ``gpu_handler`` returns ``spaces.GPU(fn)`` when the ``spaces`` package is
importable (the decorator has no effect off ZeroGPU) and ``fn`` itself when it is not,
so the same app runs unchanged locally, on a CPU Space and on a ZeroGPU Space.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping

import torch

from .. import settings
from ..engine.checkpoints.loading import default_precision, load_model
from ..engine.model import LoadedModel

logger = logging.getLogger(__name__)

RUN_SECONDS = 60  # most GPU seconds one race asks for (a 7B race of 256 tokens is well under this)
SWEEP_SECONDS = 180  # a sweep decodes every prompt at every tau


def on_zero_gpu(env: Mapping[str, str] | None = None) -> bool:
    """True on a ZeroGPU Space (the platform sets SPACES_ZERO_GPU); ``env``: None, this process's."""
    return settings.SPACES_ZERO_GPU.read(env)


def gpu_handler(fn: Callable, duration: int = RUN_SECONDS) -> Callable:
    """``spaces.GPU(duration=...)(fn)`` when ``spaces`` is importable, else ``fn`` unchanged."""
    try:
        spaces = importlib.import_module("spaces")
    except ImportError:
        return fn
    logger.info("decoding handler %s runs under spaces.GPU(duration=%d)", getattr(fn, "__name__", fn), duration)
    return spaces.GPU(duration=duration)(fn)


def zero_gpu_load(spec: str | None = None, precision: str | None = None) -> LoadedModel:
    """The app's loader on ZeroGPU: plain weights loaded on the CPU, then moved to CUDA in bf16 (fp32 on request).

    No CPU compute path is measured (decoding runs on the GPU); ``.to("cuda")`` outside a
    GPU function is what ZeroGPU expects: it is replayed in the worker when a GPU is attached.
    """
    lm = load_model(spec, device="cpu")
    dtype = torch.float32 if (precision or default_precision()) == "fp32" else torch.bfloat16
    lm.model.to(device="cuda", dtype=dtype)
    return lm
