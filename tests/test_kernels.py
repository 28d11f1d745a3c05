"""The CPU fast path (kernels.py): same numbers as nn.Linear, same state dict, decoding unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import PROMPTS, make_lm
from mars_demo.config import DecodeConfig
from mars_demo.decoding import collect, generate
from mars_demo.kernels import SMALL_ROWS, DualLayoutLinear, install_dual_layout
from mars_demo.loading import load_model


@pytest.mark.parametrize("bias", [False, True])
def test_dual_layout_linear_equals_linear_for_every_row_count(bias):
    torch.manual_seed(0)
    plain = nn.Linear(24, 40, bias=bias)
    model = nn.Sequential(nn.Linear(24, 40, bias=bias))
    model[0].load_state_dict(plain.state_dict())
    assert install_dual_layout(model) == 1 and isinstance(model[0], DualLayoutLinear)
    for shape in [(1, 24), (SMALL_ROWS, 24), (SMALL_ROWS + 1, 24), (2, 7, 24), (3, 1, 24)]:
        x = torch.randn(shape)
        torch.testing.assert_close(model(x), plain(x), rtol=1e-5, atol=1e-5)
    assert set(model.state_dict()) == {f"0.{k}" for k in plain.state_dict()}  # the copy is not saved


def test_gradients_still_reach_the_weight():
    layer = nn.Sequential(nn.Linear(8, 8))
    install_dual_layout(layer)
    layer(torch.randn(6, 8)).sum().backward()  # 6 rows: the fast path's size, but a weight that wants a gradient
    assert layer[0].weight.grad is not None and layer[0].weight.grad.abs().sum() > 0


def test_installed_model_decodes_exactly_as_before_and_keeps_its_head():
    plain, fast = make_lm("llama"), make_lm("llama")
    count = install_dual_layout(fast.model)
    assert count == sum(type(m) is nn.Linear for m in plain.model.modules()) - 1  # every projection but the LM head
    assert type(fast.model.get_output_embeddings()) is nn.Linear
    for tau in (1.0, 0.5):
        config = DecodeConfig(tau=tau, max_new_tokens=20)
        assert collect(generate(fast, PROMPTS[0], config)).token_ids == collect(generate(plain, PROMPTS[0], config)).token_ids


def test_load_model_installs_it_only_when_asked(model_dir):
    def dual(lm):
        return sum(isinstance(m, DualLayoutLinear) for m in lm.model.modules())

    assert dual(load_model(model_dir)) == 0
    assert dual(load_model(model_dir, fast_cpu=True)) > 0
