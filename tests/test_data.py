"""The chunked, resumable data command: held-out chunks never reach the training file."""

from __future__ import annotations

import json

from mars_demo.cli import main
from mars_demo.commands import data as data_command
from mars_demo.research.distillation import read_jsonl

from conftest import make_lm


def test_data_command_holds_out_chunks_and_resumes(tmp_path, monkeypatch):
    lm = make_lm("llama")
    monkeypatch.setattr(data_command, "load_model", lambda spec, **options: lm)
    # The tiny random model rarely ends a request, so the prompts are made up; the answers are really distilled.
    monkeypatch.setattr(
        data_command, "sample_prompts", lambda lm, n, seed, batch_size: [f"request {seed}-{i}" for i in range(n)]
    )
    args = ["data", "--out-dir", str(tmp_path), "--chunk-size", "3", "--heldout-every", "2", "--max-new-tokens", "4"]
    assert main([*args, "--chunks", "3"]) == 0
    prompts = read_jsonl(tmp_path / "prompts.jsonl")
    expected = [(0, "heldout")] * 3 + [(1, "train")] * 3 + [(2, "heldout")] * 3
    assert [(r["chunk"], r["split"]) for r in prompts] == expected
    distilled = read_jsonl(tmp_path / "distill.jsonl")
    assert [r["prompt"] for r in distilled] == [f"request 1001-{i}" for i in range(3)]
    assert all(0 < len(r["response_ids"]) <= 4 for r in distilled)
    heldout = [r["prompt"] for r in prompts if r["split"] == "heldout"]
    assert json.loads((tmp_path / "heldout.json").read_text()) == heldout

    assert main([*args, "--chunks", "4"]) == 0  # continues with chunk 3 only
    assert [r["chunk"] for r in read_jsonl(tmp_path / "prompts.jsonl")][-3:] == [3, 3, 3]
    assert len(read_jsonl(tmp_path / "distill.jsonl")) == 6


def test_read_jsonl_skips_a_half_written_last_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n{"a": ')
    assert read_jsonl(path) == [{"a": 1}, {"a": 2}]
