"""The generate command: JSON lines, prompts files, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mars_demo.cli import main
from mars_demo.engine.decoding.loop import capped_width


def test_generate_json_lines_for_a_prompts_file(model_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["Explain why the sky is blue.", "Write a story about a fox."]))
    code = main([
        "generate", "--model", model_dir, "--prompts-file", str(prompts), "--tau", "0.3", "--max-new-tokens", "16",
        "--json",
    ])
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in lines] == json.loads(prompts.read_text())
    for r in lines:
        assert r["model"] == model_dir
        assert sum(len(s["tokens"]) for s in r["steps"]) == len(r["token_ids"]) <= 16
        assert r["forward_passes"] == len(r["steps"])
        assert r["tokens_per_forward"] == pytest.approx(len(r["token_ids"]) / r["forward_passes"], abs=1e-3)
        assert all(s["tau"] == 0.3 and len(s["confidences"]) == len(s["tokens"]) for s in r["steps"])


def test_generate_max_fed_none_gives_the_full_window(model_dir, capsys):
    """tau 0 accepts every candidate: the paper's window gives B per pass, a cap fewer; auto prices each pass's
    width on the measured path's curve (engine/decoding/width.py; tests/test_width.py holds it to injected curves)."""
    def run(*flags):
        assert main(["generate", "--model", model_dir, "--prompt", "Count.", "--tau", "0", "--block-size", "4",
                     "--max-new-tokens", "16", "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)

    assert [len(s["tokens"]) for s in run("--max-fed", "none")["steps"]] == [4, 4, 4, 4]
    capped = [len(s["tokens"]) for s in run("--max-fed", "3")["steps"]]
    assert capped[:3] == [4, capped_width(4, 4, 3), capped_width(4, capped[1], 3)]
    auto = run()
    assert auto["compute_path"]["costs_ms"] and all(1 <= len(s["tokens"]) <= 4 for s in auto["steps"])


def test_generate_exact_mode_prints_the_origin_of_each_token_greedy_or_sampled(model_dir, capsys):
    def run(*flags):
        argv = ["generate", "--model", model_dir, "--prompt", "Count.", "--max-new-tokens", "12", "--json", *flags]
        assert main(argv) == 0
        return json.loads(capsys.readouterr().out)

    ar, exact = run("--mode", "ar"), run("--mode", "exact")
    assert exact["token_ids"] == ar["token_ids"]
    assert all(len(s["origins"]) == len(s["tokens"]) and set(s["origins"]) <= {"ar", "draft"} for s in exact["steps"])
    flags = ("--mode", "exact", "--temperature", "0.8", "--top-p", "0.95", "--top-k", "20", "--seed", "3")
    sampled = run(*flags)
    assert run(*flags)["token_ids"] == sampled["token_ids"]  # seeded: reproducible
    origins = {o for s in sampled["steps"] for o in s["origins"]}
    assert origins <= {"ar", "draft", "resampled", "bonus"}
    # a sampled run may draw a stop id; which one it draws depends on the layouts, priced on this machine's curve
    assert len(sampled["token_ids"]) == 12 or (sampled["finish_reason"] == "eos" and len(sampled["token_ids"]) < 12)


def test_generate_plain_text_and_line_prompts(model_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\n\nsecond prompt\n")
    argv = ["generate", "--model", model_dir, "--prompts-file", str(prompts), "--mode", "ar", "--max-new-tokens", "4"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.err.count("[ar]") == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", ""], "empty"),
        (["--prompt", "hi", "--tau", "1.5"], "tau"),
        (["--prompt", "hi", "--tau", "abc"], "tau"),
        (["--prompt", "hi", "--max-fed", "1"], "max-fed"),
        (["--prompt", "hi", "--block-size", "0"], "block size"),
        (["--prompt", "hi", "--max-new-tokens", "0"], "max new tokens"),
        (["--prompt", "hi", "--model", "/no/such/model"], "unknown model"),
        (["--prompts-file", "/no/such/file.json"], "not found"),
        (["--prompt", "hi", "--temperature", "nan"], "temperature"),
        (["--prompt", "hi", "--temperature", "0.7", "--top-p", "0"], "top-p"),
        (["--prompt", "hi", "--temperature", "0.7", "--top-p", "1.5"], "top-p"),
        (["--prompt", "hi", "--temperature", "0.7", "--top-p", "nan"], "top-p"),
        (["--prompt", "hi", "--temperature", "0.7", "--top-k", "-1"], "top-k"),
        (["--prompt", "hi", "--temperature", "0.7", "--top-k", "2.5"], "top-k"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    parse_error = "abc" in args or "--max-fed" in args or "2.5" in args  # argparse refuses these itself
    with pytest.raises(SystemExit) if parse_error else _no_raise() as raised:
        code = main(["generate", *args])
    code = raised.value.code if parse_error else code
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("error:") and message in err
    assert "Traceback" not in err


class _no_raise:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_training_commands_need_neither_plotly_nor_gradio():
    """A bare GPU machine has torch, transformers and peft, but no plotly or gradio."""
    code = (
        "import sys; sys.modules['plotly'] = sys.modules['gradio'] = None\n"  # any import of them fails
        "from mars_demo.cli import main\n"
        "for command in ('data', 'distill', 'train', 'eval', 'generate'):\n"
        "    try:\n"
        "        main([command, '--help'])\n"
        "    except SystemExit as done:\n"
        "        assert done.code == 0, command\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--max-repeat" in result.stdout
