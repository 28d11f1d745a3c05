"""The engine's rooms and what they may import; no runtime patching; modules of a readable size.

Inside the engine (docs/ARCHITECTURE.md):

- ``backends`` (how a model runs) imports nothing of the engine above it: the decoding method,
  checkpoints, serving and ``model`` are out of its reach;
- ``model`` (a loaded checkpoint) sits on the backends;
- ``decoding`` (the method) reaches a model only through the backends' interface and ``model``:
  never checkpoints or serving;
- ``checkpoints`` (loading and hosting) may use the decoding method's rate model to choose a path,
  never serving;
- ``serving`` sits on decoding.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from test_layout import PACKAGE, _imports, _module_name

ENGINE = "mars_demo.engine"
ROOMS = ("backends", "checkpoints", "decoding", "serving", "model")
MAY_NOT = {
    "backends": ("checkpoints", "decoding", "serving", "model"),
    "model": ("checkpoints", "decoding", "serving"),
    "decoding": ("checkpoints", "serving"),
    "checkpoints": ("serving",),
    "serving": ("checkpoints",),
}
MAX_MODULE_LINES = 450
# What patching a transformers model looks like (issue #32): none of it in the package.
PATCHES = (r"\.forward\s*=[^=]", r"__signature__", r"object\.__setattr__", r"mars_compute",
           r"AttentionInterface\.register", r"AttentionMaskInterface\.register")


def _room(module: str) -> str | None:
    parts = module.split(".")
    if module.startswith(ENGINE + ".") and parts[2] in ROOMS:
        return parts[2]
    return None


ENGINE_FILES = sorted((PACKAGE / "engine").rglob("*.py"))


@pytest.mark.parametrize("path", ENGINE_FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_engine_room_imports_only_below_it(path):
    room = _room(_module_name(path))
    if room is None:
        return
    bad = sorted(name for name in _imports(path) if _room(name) in MAY_NOT[room])
    assert not bad, f"{path.relative_to(PACKAGE)} ({room}) imports {bad}"


def test_no_module_is_over_the_line_limit():
    sources = sorted(PACKAGE.rglob("*.py")) + [PACKAGE.parent / "app.py"]
    long = {str(p.relative_to(PACKAGE.parent)): n for p in sources
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_nothing_patches_a_model_at_run_time():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            if any(re.search(pattern, code) for pattern in PATCHES):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert not found, found


def test_the_decoders_take_a_backend_not_a_model():
    """No function of the decoding method or serving takes a ``PreTrainedModel``: they see base.Backend only."""
    takes_model = []
    for room in ("decoding", "serving"):
        for path in sorted((PACKAGE / "engine" / room).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for arg in node.args.args + node.args.kwonlyargs:
                        if arg.annotation is not None and "PreTrainedModel" in ast.unparse(arg.annotation):
                            takes_model.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}({arg.arg})")
    assert not takes_model, takes_model


def test_the_reference_decoders_live_with_the_tests():
    assert not list(PACKAGE.rglob("reference.py"))
    assert (Path(__file__).parent / "reference.py").is_file()
