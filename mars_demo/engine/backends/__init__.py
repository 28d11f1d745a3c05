"""How a model runs: the interface the decoders use (base.py) and one implementation per backend.

``hf.TransformersBackend`` runs a transformers model as it is; ``cpu.backend.CpuBackend`` is the CPU
engine (its own model code, cache and native kernels) for llama-family models on a CPU.
``backend_for`` picks the CPU engine for a model put on a CPU compute path (``load_model(precision=...)``,
``quant.convert``) where the engine can run it and MARS_DEMO_LEAN does not say "0"; weights loaded as
they are (training, data, a GPU) decode with transformers' forward.
"""

from __future__ import annotations

from transformers import PreTrainedModel

from ... import settings
from .base import Backend, KVCache
from .cpu.backend import CpuBackend
from .cpu.lean import unsupported
from .cpu.quant import path_of
from .hf import TransformersBackend

LEAN_ENV = settings.LEAN.name  # off: decode with transformers' forward (for comparisons)

__all__ = ["Backend", "CpuBackend", "KVCache", "TransformersBackend", "backend_for", "cpu_engine_runs"]


def cpu_engine_runs(model: PreTrainedModel) -> bool:
    """Whether ``backend_for`` gives ``model`` the CPU engine."""
    return settings.LEAN.read() and unsupported(model) is None


def backend_for(model: PreTrainedModel, compute=None, *, on_path: bool = False) -> Backend:
    """The backend that decodes ``model`` (module docstring); ``compute``: its measured CPU compute path.

    ``on_path``: the model is being put on a compute path (paths.py measures the backend it will decode on).
    """
    if (on_path or compute is not None or path_of(model) != "fp32") and cpu_engine_runs(model):
        return CpuBackend(model, compute)
    return TransformersBackend(model, compute)
