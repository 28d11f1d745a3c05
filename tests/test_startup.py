"""The first minute: a load's stages reach the status line, kernels build in the background, errors still surface."""

from __future__ import annotations

import pytest

from mars_demo.engine import progress
from mars_demo.engine.backends.cpu import native
from mars_demo.engine.checkpoints.loading import BUNDLED, ModelLoadError
from mars_demo.ui.handlers import DemoHandlers
from mars_demo.ui.loading import staged_load
from mars_demo.ui.models import ModelCache, ModelPolicy, model_choices
from mars_demo.ui.outputs import MODEL_OUTPUTS, named
from mars_demo.ui.race import Session

STAGES = ("converting the GGUF weights", "measuring int8dyn (compute path 1 of 4)")


def reporting_loader(lm):
    """A loader that reports the stages a real load reports, then serves ``lm`` (or fails for "bad" specs)."""

    def loader(spec: str, precision=None):
        for stage in STAGES:
            progress.report(stage)
        if spec.startswith("bad"):
            raise ModelLoadError(f"unknown model {spec!r}")
        return lm

    return loader


def test_a_load_yields_its_stages_then_the_model_and_a_cached_model_at_once(tiny_qwen):
    cache = ModelCache(reporting_loader(tiny_qwen))
    steps = list(staged_load(cache, "tiny", "auto"))
    assert steps[0] == "Loading tiny…" and steps[-1] is tiny_qwen
    assert [s.split(": ", 1)[1].rsplit("…", 1)[0] for s in steps[1:-1]] == list(STAGES)
    assert list(staged_load(cache, "tiny", "auto")) == [tiny_qwen]  # in memory: no stage, no thread
    progress.report("not heard")  # the listener belonged to the load's thread only


def test_a_failed_load_raises_its_own_error_after_its_stages(tiny_qwen):
    steps = staged_load(ModelCache(reporting_loader(tiny_qwen)), "bad/x", None)
    assert len([next(steps) for _ in range(1 + len(STAGES))]) == 1 + len(STAGES)  # the first line, each stage
    with pytest.raises(ModelLoadError, match="unknown model"):
        next(steps)


def test_the_status_line_shows_each_stage_while_the_page_waits(tiny_qwen, tmp_path):
    handlers = DemoHandlers(reporting_loader(tiny_qwen), policy=ModelPolicy(tuple(model_choices(False))),
                            trace_dir=tmp_path)
    lines = [named(MODEL_OUTPUTS, o)["model_line"] for o in handlers.show_model(BUNDLED, Session())]
    assert len(lines) == 2 + len(STAGES) and all(stage in line for stage, line in zip(STAGES, lines[1:]))
    assert "Loading" not in str(lines[-1])


def test_kernels_prebuild_in_the_background_into_the_cache(tmp_path, monkeypatch):
    if native.compiler() is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("MARS_DEMO_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_building", {})
    native.prebuild(("greedy",))
    native.prebuild(("greedy",))  # started once
    assert list(native._building) == ["greedy"]
    native._building["greedy"].join()
    assert len(list((tmp_path / "native").glob("greedy-*.so"))) == 1


def test_the_int8_linear_comes_from_the_decoder_library_that_includes_it(monkeypatch):
    from mars_demo.engine.backends.cpu import int8gemm

    if native.compiler() is None:
        pytest.skip("no C++ compiler")
    asked = []
    real = native.library
    monkeypatch.setattr(native, "library", lambda name: asked.append(name) or real(name))
    int8gemm.kernel.cache_clear()
    try:
        assert int8gemm.kernel() is not None and asked == ["decoder"]  # one build fewer on a first start
    finally:
        int8gemm.kernel.cache_clear()
