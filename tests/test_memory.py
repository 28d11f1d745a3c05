"""The memory guard: a model's size from metadata, free memory from /proc and the cgroup, refusal before loading."""

from __future__ import annotations

import json

import gradio as gr
import pytest

from mars_demo.engine.checkpoints import memory
from mars_demo.engine.checkpoints.loading import BUNDLED, RELEASED
from mars_demo.engine.checkpoints.memory import (
    ModelTooLarge,
    available_bytes,
    check_fits,
    needed_bytes,
    parameter_count,
)
from mars_demo.ui.handlers import DemoHandlers
from mars_demo.ui.models import ModelPolicy, model_choices
from mars_demo.ui.outputs import MODEL_OUTPUTS, named
from mars_demo.ui.race import Session

PROMPT = "Explain why the sky is blue."
GIB = 2**30


def test_free_memory_is_the_lower_of_meminfo_and_the_cgroup(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:    8388608 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert available_bytes(meminfo, cgroup) == 8 * GIB  # no cgroup files: /proc/meminfo alone
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text(str(GIB))
    assert available_bytes(meminfo, cgroup) == 8 * GIB  # no limit
    (cgroup / "memory.max").write_text(str(4 * GIB))
    assert available_bytes(meminfo, cgroup) == 3 * GIB  # a container's limit, less what it uses
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(2 * GIB))
    (v1 / "memory" / "memory.usage_in_bytes").write_text(str(GIB // 2))
    assert available_bytes(meminfo, v1) == 3 * GIB // 2
    assert available_bytes(tmp_path / "none", tmp_path / "none") > 0  # os.sysconf where there is no /proc


def test_parameter_count_from_metadata(tiny_llama, tmp_path):
    folder = tmp_path / "tiny"
    tiny_llama.model.save_pretrained(folder)
    params = sum(p.numel() for p in tiny_llama.model.parameters())
    assert parameter_count(str(folder)) == params  # the safetensors header, nothing loaded
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(folder)}))
    assert parameter_count(str(adapter)) == params  # an adapter counts its base
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "pytorch_model.bin").write_bytes(b"\0" * 1000)
    assert parameter_count(str(legacy)) == 500  # file size at 2 bytes a parameter
    assert parameter_count(RELEASED[-1]) == 7_000_000_000  # offline: the size in the released name
    assert parameter_count(BUNDLED) == pytest.approx(134.5e6, rel=0.01)
    assert parameter_count(str(tmp_path / "missing")) is None and parameter_count("not a spec") is None


def test_check_fits_against_a_patched_limit(tiny_llama, tmp_path, monkeypatch):
    folder = tmp_path / "tiny"
    tiny_llama.model.save_pretrained(folder)
    needed = needed_bytes(parameter_count(str(folder)))
    monkeypatch.setenv(memory.MARGIN_ENV, "1")
    check_fits(str(folder), available=needed + 2**20 + 1)
    with pytest.raises(ModelTooLarge) as err:
        check_fits(str(folder), available=needed + 2**20 - 1)
    assert err.value.needed == needed and "GB of memory" in str(err.value) and str(folder) not in str(err.value)
    with pytest.raises(ModelTooLarge):
        check_fits(RELEASED[-1], available=24 * GIB)  # a 7B checkpoint on a 24 GB host
    check_fits(BUNDLED, available=4 * GIB)


def test_every_compute_path_has_its_own_measured_load_factor():
    from mars_demo.engine.backends.cpu.paths import PRECISIONS

    assert set(memory.LOAD_FACTORS) == set(PRECISIONS)  # no path falls back to the largest unmeasured
    params = 134_515_008
    by_path = {p: needed_bytes(params, p) for p in PRECISIONS}
    assert by_path["fp32"] < by_path["int8"] <= by_path["bf16"] < by_path["int8dyn"] < by_path["auto"]
    assert needed_bytes(params, "no-such-path") == by_path["auto"]


def test_the_app_refuses_a_model_that_would_not_fit_before_loading_it(tiny_llama, tmp_path, monkeypatch):
    folder = tmp_path / "big"
    tiny_llama.model.save_pretrained(folder)
    calls = []

    def loader(spec, precision=None):
        calls.append(spec)
        return tiny_llama

    listed = ModelPolicy(tuple(model_choices(False, (str(folder),))), free=False)
    handlers = DemoHandlers(loader, policy=listed, trace_dir=tmp_path / "traces")
    list(handlers.show_model(BUNDLED, Session()))
    assert calls == [BUNDLED]
    free = 2 * needed_bytes(parameter_count(str(folder)))
    monkeypatch.setattr(memory, "available_bytes", lambda: free)
    monkeypatch.setenv(memory.MARGIN_ENV, str(free / 2**20))  # the margin leaves no room
    session = Session()
    with pytest.warns(UserWarning, match="GB of memory"):
        *_, last = handlers.show_model(str(folder), session)
    status, picker = named(MODEL_OUTPUTS, last)["model_line"], named(MODEL_OUTPUTS, last)["model"]
    assert "GB of memory" in status and "Still serving smollm2-135m-mars" in status and picker == BUNDLED
    with pytest.raises(gr.Error, match="pick a smaller one") as err:
        next(handlers.run(PROMPT, str(folder), 0.9, 4, 8, "probability", 0.0, False, True, session))
    assert err.value.title == "Model not loaded"
    assert calls == [BUNDLED] and handlers.models.loaded() == [BUNDLED]  # never loaded, nothing dropped
    # a typed folder (free text on) that would not fit gets the one refusal, not its size
    handlers.policy = ModelPolicy(tuple(model_choices(False)), free=True)
    with pytest.raises(gr.Error) as err:
        next(handlers.run(PROMPT, str(folder), 0.9, 4, 8, "probability", 0.0, False, True, Session()))
    assert err.value.message == handlers.policy.refusal
    monkeypatch.setenv(memory.MARGIN_ENV, "0")  # room again: it loads
    handlers.policy = listed
    list(handlers.show_model(str(folder), Session()))
    assert calls == [BUNDLED, str(folder)]
