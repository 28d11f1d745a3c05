"""scripts/path_quality.py: each compute path's greedy outputs against fp32's, scored by fp32."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

from conftest import PROMPTS, make_lm

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "path_quality.py"
spec = importlib.util.spec_from_file_location("path_quality", SCRIPT)
path_quality = importlib.util.module_from_spec(spec)
spec.loader.exec_module(path_quality)


def test_each_path_is_compared_with_fp32s_own_outputs(tmp_path, monkeypatch):
    monkeypatch.setenv("MARS_DEMO_CACHE", str(tmp_path / "cache"))  # the paths' cost table, measured here
    tiny = make_lm("llama")
    directory = tmp_path / "tiny-llama"
    tiny.model.save_pretrained(directory)
    tiny.tokenizer.save_pretrained(directory)
    report = path_quality.compare(str(directory), PROMPTS[:2], ["int8dyn"], max_new_tokens=8)
    fp32, int8dyn = report["paths"]
    assert fp32["path"] == "fp32" and int8dyn["path"] == "int8dyn" and report["count"] == 2
    assert fp32["agreement"] == fp32["exact_match"] == 1.0 and fp32["dnll_fp32"] == 0.0 and fp32["tokens"] > 0
    assert 0.0 <= int8dyn["exact_match"] <= int8dyn["agreement"] <= 1.0  # an identical output agrees wholly
    assert math.isfinite(int8dyn["dnll_fp32"]) and int8dyn["tokens"] > 0
    assert isinstance(int8dyn["calibration_dnll"], float)  # the check auto ran before allowing the path
