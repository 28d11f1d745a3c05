"""The package's rooms: the engine sits at the bottom and imports neither research, ui, Gradio nor plotly."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mars_demo"
ENGINE = PACKAGE / "engine"
FORBIDDEN = ("mars_demo.research", "mars_demo.ui", "mars_demo.commands", "mars_demo.cli", "gradio", "plotly")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports, at any depth (lazy imports included)."""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


ENGINE_FILES = sorted(ENGINE.rglob("*.py"))


@pytest.mark.parametrize("path", ENGINE_FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_engine_source_imports_nothing_above_it(path):
    bad = sorted(name for name in _imports(path) if name.startswith(FORBIDDEN))
    assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


@pytest.mark.parametrize("room, other", [("research", "ui"), ("ui", "research")])
def test_research_and_ui_do_not_import_each_other(room, other):
    for path in sorted((PACKAGE / room).rglob("*.py")):
        bad = sorted(name for name in _imports(path) if name.startswith(f"mars_demo.{other}"))
        assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


def test_importing_the_engine_loads_nothing_above_it():
    modules = [_module_name(p) for p in ENGINE_FILES]
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False,
                            cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert "mars_demo.engine.decoding.loop" in loaded
    bad = [name for name in loaded if name.startswith(FORBIDDEN)]
    assert not bad, f"importing the engine loaded {bad}"


def test_every_room_exists_and_the_root_holds_no_loose_modules():
    rooms = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert {"engine", "research", "ui", "commands"} <= rooms
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "cli.py", "settings.py"], loose


def test_the_settings_module_sits_below_everything():
    """mars_demo/settings.py imports nothing of mars_demo, so every room (the engine too) may import it."""
    ours = sorted(name for name in _imports(PACKAGE / "settings.py") if name.startswith("mars_demo"))
    assert not ours, f"settings.py imports {ours}"


def _environment_reads(path: Path) -> list[int]:
    """Lines where ``path`` reads the environment (``os.environ``, ``os.getenv``); writing to it is no read."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    writes = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
            writes.add(id(node.value))  # os.environ[name] = value; del os.environ[name]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "setdefault":
            writes.add(id(node.func.value))  # os.environ.setdefault(name, value): a default for a child, set
    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in ("environ", "environb", "getenv")
                and isinstance(node.value, ast.Name) and node.value.id == "os" and id(node) not in writes):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            lines += [node.lineno for alias in node.names if alias.name in ("environ", "environb", "getenv")]
    return sorted(lines)


def _readers() -> list[str]:
    sources = [p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "settings.py" or p.parent != PACKAGE]
    found = []
    for path in sources + [PACKAGE.parent / "app.py"]:
        name = path.relative_to(PACKAGE).as_posix() if path.is_relative_to(PACKAGE) else path.name
        found += [f"{name}:{line}" for line in _environment_reads(path)]
    return found


def test_the_environment_is_read_in_settings_only():
    """Issue #32: every variable is declared once, in mars_demo/settings.py, and read through it."""
    assert not _readers(), "read os.environ through mars_demo.settings instead"


MAX_FUNCTION_LINES = 60  # CONTRIBUTING: functions about 60 lines at most (docstring and decorators included)


def test_functions_are_short():
    sources = sorted(PACKAGE.rglob("*.py")) + [PACKAGE.parent / "app.py"]
    long = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if node.end_lineno - start + 1 > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="pip install -r requirements.txt (ruff)")
def test_ruff_is_clean():
    """CONTRIBUTING's check: ruff's default rules at line length 120 (pyproject.toml)."""
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], capture_output=True, text=True,
                            timeout=120, check=False, cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_environment_check_tells_reads_from_writes(tmp_path):
    source = tmp_path / "example.py"
    source.write_text("import os\nos.environ['A'] = '1'\nos.environ.setdefault('B', '2')\ndel os.environ['A']\n"
                      "x = os.environ.get('C')\ny = os.getenv('D')\nfrom os import environ\n", encoding="utf-8")
    assert _environment_reads(source) == [5, 6, 7]
