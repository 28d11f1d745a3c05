"""Decoding on a GPU leaves cuDNN's attention out (backends/hf.py's docstring: it builds a graph per shape).

The switch is torch's own and process-wide, so it is checked here on the CPU: what a GPU device sets and
what a CPU backend leaves alone.
"""

from __future__ import annotations

import pytest
import torch

from mars_demo.engine.backends.hf import TransformersBackend, leave_out_cudnn_attention

from conftest import make_lm


@pytest.fixture
def cudnn_switch():
    """torch's cuDNN SDPA switch, on at the start (torch's default) and restored afterwards."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def kernels_on() -> dict[str, bool]:
    cuda = torch.backends.cuda
    return {
        "cudnn": cuda.cudnn_sdp_enabled(), "flash": cuda.flash_sdp_enabled(),
        "efficient": cuda.mem_efficient_sdp_enabled(), "math": cuda.math_sdp_enabled(),
    }


def test_a_gpu_device_switches_cudnn_attention_off_and_nothing_else(cudnn_switch):
    before = kernels_on()
    leave_out_cudnn_attention(torch.device("cpu"))
    assert kernels_on() == before  # not a GPU: torch's choice
    leave_out_cudnn_attention(torch.device("cuda", 0))
    assert kernels_on() == {**before, "cudnn": False}


def test_a_cpu_backend_leaves_torchs_attention_as_it_was_and_decodes(cudnn_switch):
    lm = make_lm("llama")
    backend = TransformersBackend(lm.model)
    assert kernels_on()["cudnn"]
    logits = backend.forward(torch.tensor([[5, 6, 7, 8]]), backend.new_cache(), keep=4)
    assert logits.shape[:2] == (1, 4) and torch.isfinite(logits).all()
