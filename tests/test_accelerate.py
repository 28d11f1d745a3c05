"""`train` under `accelerate launch`: two CPU processes (DDP over gloo) train like one process.

Two processes with batch 2 each see, per optimizer step, the same two micro-batches that
one process with batch 2 and ``--grad-accum 2`` sees (the shared stream is dealt out in
turn), and DDP averages their gradients as accumulation does: so the loss curves agree
to float rounding, and the checkpoint the main process saves loads and decodes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_training import tied_lm, tiny_rows

from mars_demo import cli
from mars_demo.engine.checkpoints.loading import load_model
from mars_demo.engine.decoding.config import DecodeConfig
from mars_demo.engine.decoding.loop import collect, generate

from conftest import PROMPTS, make_tokenizer

ROOT = Path(__file__).resolve().parent.parent
ACCELERATE = Path(sys.executable).with_name("accelerate")
STEPS = 8


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, Path, list[str]]:
    root = tmp_path_factory.mktemp("ddp")
    model, tokenizer = tied_lm()
    model.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in tiny_rows(make_tokenizer(None), 16)))
    args = ["train", "--base", str(root / "base"), "--data", str(data), "--lora-rank", "8", "--lr", "1e-2",
            "--max-steps", str(STEPS), "--batch-size", "2", "--save-every", "4"]
    return root, data, args


def losses(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "loss.jsonl").read_text().splitlines()]


@pytest.mark.skipif(not ACCELERATE.is_file(), reason="needs accelerate's launcher")
def test_two_cpu_processes_train_like_one_with_accumulation(setup, capfd):
    root, _, args = setup
    one = root / "one"
    assert cli.main([*args, "--out", str(one), "--grad-accum", "2"]) == 0

    two = root / "two"
    # --multi_gpu is accelerate's torchrun launch; with no GPU visible it runs MULTI_CPU over gloo
    # (its --cpu flag with several processes needs an MPI host file).
    launch = [str(ACCELERATE), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
              "-m", "mars_demo", *args, "--out", str(two)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(launch, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count(f"{STEPS}/{STEPS} steps") == 1  # only the main process reports

    want, got = losses(one), losses(two)
    assert [h["step"] for h in got] == list(range(1, STEPS + 1))
    for a, b in zip(want, got):
        for key in ("loss", "noisy_loss", "ar_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-4)
        assert b["lr"] == pytest.approx(a["lr"])
    summary = json.loads((two / "training.json").read_text())
    assert summary["steps"] == STEPS and summary["hardware"].startswith("2 processes x ")
    assert summary["epochs"] == json.loads((one / "training.json").read_text())["epochs"]

    lm = load_model(str(two))
    out = collect(generate(lm, PROMPTS[0], DecodeConfig(tau=0.9, max_new_tokens=8)))
    assert out.stats.tokens > 0 and out.stats.forward_passes <= out.stats.tokens


def test_processes_deal_out_the_shared_stream_in_turn():
    """Each optimizer step takes the next micro-batches of one shared, resumable stream, one per process."""
    from types import SimpleNamespace

    from mars_demo.research.training import TrainConfig, micro_batches, total_steps
    from mars_demo.research.training.parallel import shard

    lengths = list(range(10, 30))
    shared = micro_batches(lengths, 2, seed=0)
    expected = [next(shared) for _ in range(8)]
    ranks = [shard(micro_batches(lengths, 2, seed=0), SimpleNamespace(num_processes=2, process_index=rank))
             for rank in (0, 1)]
    dealt = [next(ranks[step % 2]) for step in range(8)]
    assert dealt == expected
    config = TrainConfig(batch_size=2, grad_accum=2, epochs=2)
    assert total_steps(20, config, 2) == total_steps(20, TrainConfig(batch_size=2, grad_accum=4, epochs=2)) == 5
