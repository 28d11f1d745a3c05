"""The machine and software a report's figures were taken on (``bench``, ``serve-sim``), and whether its rows are
computed alone (``row_exact``)."""

from __future__ import annotations

import os
import platform

import torch
import transformers

from .. import settings
from ..engine.backends.cpu import int8gemm
from ..engine.backends.cpu.backend import CpuBackend
from ..engine.decoding.surface import known_surface
from ..engine.machine import cpu_identity, cpu_model
from ..engine.model import LoadedModel


def machine(lm: LoadedModel) -> dict:
    """The machine and software the numbers were taken on."""
    model, backend, compute = lm.model, lm.backend, lm.compute
    desc = {
        "cpu": cpu_model(),
        "cpu_identity": cpu_identity(),  # what the cost tables and surfaces are kept under (machine.cpu_identity)
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": settings.OMP_NUM_THREADS.read(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "backend": type(backend).__name__,
        "attention": backend.lean.attention if isinstance(backend, CpuBackend) else model.config._attn_implementation,
        # prefills start from stored prompt prefixes (backends/cpu/prefixes.py): every method alike
        "prefix_reuse": isinstance(backend, CpuBackend) and backend.prefixes is not None,
        "compute_path": compute.record() if compute is not None else None,
        "cost_surface": surface.record() if (surface := known_surface(lm)) is not None else None,
        "int8_gemm": int8gemm.record(),  # its tiles and prefetches, timed at load: tables depend on them
    }
    if model.device.type == "cuda":
        desc["gpu"] = torch.cuda.get_device_name(model.device)
    return desc


def row_exact(lm: LoadedModel) -> bool:
    """Whether each row of a pass is computed alone here: the CPU engine on a path other than fp32."""
    return isinstance(lm.backend, CpuBackend) and lm.compute is not None and lm.compute.path != "fp32"
