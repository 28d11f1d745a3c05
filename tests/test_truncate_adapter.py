"""scripts/truncate_adapter.py: a lower-rank adapter is the best approximation of each LoRA delta."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "truncate_adapter.py"
spec = importlib.util.spec_from_file_location("truncate_adapter", SCRIPT)
truncate_adapter = importlib.util.module_from_spec(spec)
spec.loader.exec_module(truncate_adapter)


def test_full_rank_keeps_the_delta_and_lower_rank_is_the_svd_optimum():
    torch.manual_seed(0)
    a, b = torch.randn(8, 24), torch.randn(16, 8)
    weights = {"x.lora_A.weight": a, "x.lora_B.weight": b, "emb.delta": torch.ones(3)}
    delta = 2.0 * b @ a
    full, kept = truncate_adapter.truncate(weights, 2.0, 8)
    assert kept == [1.0] and torch.equal(full["emb.delta"], weights["emb.delta"])
    assert torch.allclose(full["x.lora_B.weight"].float() @ full["x.lora_A.weight"].float(), delta, atol=0.05)
    low, (energy,) = truncate_adapter.truncate(weights, 2.0, 3)
    approx = low["x.lora_B.weight"].float() @ low["x.lora_A.weight"].float()
    s = torch.linalg.svdvals(delta.double())
    assert low["x.lora_A.weight"].shape == (3, 24) and low["x.lora_B.weight"].dtype == torch.float16
    assert abs(energy - float((s[:3] ** 2).sum() / (s**2).sum())) < 1e-6
    assert abs(torch.linalg.norm(delta - approx).item() - float((s[3:] ** 2).sum().sqrt())) < 0.05
