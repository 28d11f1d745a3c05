"""Decode passes on a GPU leave cuDNN's attention out (backends/hf.py's docstring: it builds a graph per shape).

The scope is torch's own SDPA switch, so it is checked here on the CPU: what the switch says inside a
pass, and that a pass's numbers do not change under it.
"""

from __future__ import annotations

import torch

from mars_demo.engine.backends.hf import DECODE_SDPA, TransformersBackend, decode_attention

from conftest import make_lm


def kernels_on() -> dict[str, bool]:
    cuda = torch.backends.cuda
    return {
        "cudnn": cuda.cudnn_sdp_enabled(), "flash": cuda.flash_sdp_enabled(),
        "efficient": cuda.mem_efficient_sdp_enabled(), "math": cuda.math_sdp_enabled(),
    }


def test_the_scope_switches_off_cudnn_alone_on_a_gpu_and_restores_it():
    before = kernels_on()
    assert before["cudnn"], "torch's default lets SDPA choose cuDNN"
    with decode_attention(True):
        assert kernels_on() == {"cudnn": False, "flash": True, "efficient": True, "math": True}
    assert kernels_on() == before
    with decode_attention(False):
        assert kernels_on() == before  # not a GPU: torch's choice
    with decode_attention(True, None):
        assert kernels_on() == before  # kernels None: torch's choice (batch_turns.py --torch-attention)


def test_a_gpu_backend_runs_its_passes_in_the_scope_and_the_numbers_stay():
    lm = make_lm("llama")
    seen: list[bool] = []
    hook = lm.model.register_forward_pre_hook(lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    ids = torch.tensor([[5, 6, 7, 8]])
    try:
        cpu = TransformersBackend(lm.model)
        assert cpu.sdpa == DECODE_SDPA
        plain = cpu.forward(ids, cpu.new_cache(), keep=4)
        gpu = TransformersBackend(lm.model)
        gpu._on_gpu = True  # a GPU backend's scope around the CPU's tensors: the CPU's SDPA obeys the same switch
        scoped = gpu.forward(ids, gpu.new_cache(), keep=4)
        gpu.sdpa = None
        gpu.forward(ids, gpu.new_cache(), keep=4)
    finally:
        hook.remove()
    assert seen == [True, False, True]  # CPU: torch's choice; GPU: cuDNN out; sdpa None: torch's choice
    assert torch.equal(plain, scoped)
