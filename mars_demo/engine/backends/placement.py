"""Where a decoding pass puts its tensors, also for models spread over devices by accelerate.

A checkpoint loaded with ``device_map="auto"`` (the 7B ones on several GPUs), or dispatched
with CPU / disk offload, has its layers on several devices and offloaded weights on the
``meta`` device, so ``model.device`` (the first parameter's) may be ``meta`` or a device
the first layer does not use. A pass's inputs and masks go where accelerate runs the
model's first layer (``input_device``); its logits come back from the last layer, on
whatever device that is, and everything computed from them (sampling included: see
``SeededGenerator``) stays on the logits' device.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ... import settings

_threads_chosen = False  # a user set torch's intra-op threads (choose_host_threads): a GPU load keeps them


def choose_host_threads(count: int) -> None:
    """torch's intra-op threads, as a user chose them (``bench --threads``, MARS_DEMO_THREADS)."""
    global _threads_chosen
    torch.set_num_threads(count)
    _threads_chosen = True


def settle_gpu_host(device: torch.device, decoding: bool = True) -> None:
    """One intra-op thread for a process decoding on a GPU, unless a user chose (or OMP_NUM_THREADS set) a count;
    ``decoding`` False (a load for training or data) leaves torch's count.

    The host only queues kernels and reads back a few numbers a pass; torch's team of a thread per
    core wakes for each of its small host operations, and a launch-bound pass waits for it
    (BENCHMARKS.md, "GPU").
    """
    if decoding and device.type == "cuda" and not _threads_chosen and settings.OMP_NUM_THREADS.read() is None:
        torch.set_num_threads(1)


def _execution_device(module: torch.nn.Module) -> torch.device | None:
    """The execution device of accelerate's hook on ``module`` (one hook, or the first of a SequentialHook)."""
    hook = getattr(module, "_hf_hook", None)
    for each in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):
        device = getattr(each, "execution_device", None)
        if device is not None:
            return torch.device(device)  # an int is a CUDA index
    return None


def input_device(model: PreTrainedModel) -> torch.device:
    """Where a pass's input ids, position ids and masks go: the device that runs the input embeddings."""
    device = _execution_device(model)  # dispatched: accelerate moves every input here anyway
    if device is not None:
        return device
    embed = model.get_input_embeddings()
    device = _execution_device(embed) or embed.weight.device
    return torch.device("cpu") if device.type == "meta" else device


class SeededGenerator:
    """A seeded torch.Generator made on the device the logits arrive on, at the first draw.

    For a model on one device that is the model's device, so draws are the same as with a
    generator made up front; for a dispatched model it is the last layer's device.
    """

    def __init__(self, seed: int | None) -> None:
        self.seed = seed
        self._generator: torch.Generator | None = None

    def on(self, device: torch.device) -> torch.Generator | None:
        if self.seed is None:
            return None
        if self._generator is None:
            self._generator = torch.Generator(device=device).manual_seed(self.seed)
        return self._generator
