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
