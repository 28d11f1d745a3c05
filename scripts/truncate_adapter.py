"""A LoRA adapter at a lower rank: the best rank-r approximation (SVD) of each layer's delta, saved in fp16.

    python scripts/truncate_adapter.py assets/smollm2-135m-mars runs/adapter-r32 --rank 32

Also prints how much of each delta's energy (squared Frobenius norm) the rank keeps. The
result loads like any adapter folder (``--model runs/adapter-r32``); compare it with the
source on held-out rows with ``validate`` before using it (docs/bench/history.md, "Bundled adapter size").
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def truncate(weights: dict[str, torch.Tensor], scale: float, rank: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """(new weights with every lora_A / lora_B pair at ``rank`` and scale 1, energy kept per pair)."""
    out, kept = {}, []
    for name, tensor in weights.items():
        if "lora_B" in name:
            continue
        if "lora_A" not in name:
            out[name] = tensor  # e.g. the trainable token rows
            continue
        b_name = name.replace("lora_A", "lora_B")
        delta = scale * (weights[b_name].double() @ tensor.double())  # (out, in)
        u, s, vh = torch.linalg.svd(delta, full_matrices=False)
        kept.append(float((s[:rank] ** 2).sum() / (s**2).sum()))
        root = s[:rank].sqrt()
        out[b_name] = (u[:, :rank] * root).half().contiguous()
        out[name] = (root[:, None] * vh[:rank]).half().contiguous()
    return out, kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="adapter folder (adapter_config.json, adapter_model.safetensors)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--rank", type=int, required=True)
    args = parser.parse_args()
    config = json.loads((args.source / "adapter_config.json").read_text())
    weights, kept = truncate(load_file(args.source / "adapter_model.safetensors"),
                             config["lora_alpha"] / config["r"], args.rank)
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(weights, args.out / "adapter_model.safetensors", metadata={"format": "pt"})
    config.update(r=args.rank, lora_alpha=float(args.rank))  # scale 1: the factors carry the delta
    (args.out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    for extra in ("mars.json",):
        if (args.source / extra).is_file():
            shutil.copy(args.source / extra, args.out / extra)
    size = (args.out / "adapter_model.safetensors").stat().st_size
    print(f"rank {args.rank}: {size / 1e6:.1f} MB; energy kept: mean {sum(kept) / len(kept):.4f}, min {min(kept):.4f}")


if __name__ == "__main__":
    main()
