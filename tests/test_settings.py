"""The settings module: every variable declared once, read at each call, a bad value one line, the docs in step."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mars_demo import settings
from mars_demo.cli import main
from mars_demo.settings import DECLARED, SettingError

ROOT = Path(__file__).resolve().parents[1]
HOSTING = ROOT / "docs" / "hosting.md"
GUIDES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "NOTES.md", *sorted((ROOT / "docs").glob("*.md"))]
FREE_TEXT = (settings.TEXT, settings.FOLDER, settings.SPECS)  # kinds that take any text
OURS = [s for s in DECLARED.values() if s.group != "platform"]


def _documented_rows() -> dict[str, list[str]]:
    """docs/hosting.md's table rows by variable: the cells after the name."""
    rows = {}
    for line in HOSTING.read_text(encoding="utf-8").splitlines():
        found = re.match(r"\| `([A-Z][A-Z0-9_]+)` \|(.*)\|$", line)
        if found:
            rows[found.group(1)] = [cell.strip() for cell in found.group(2).split(" | ")]
    return rows


def test_the_docs_tables_are_written_from_the_declarations():
    text = HOSTING.read_text(encoding="utf-8")
    assert text.count("<!-- settings:") == len(settings.GROUPS)
    assert settings.fill_tables(text) == text, "python -m mars_demo settings --docs docs/hosting.md"


def test_every_declared_variable_is_documented_with_its_default():
    rows = _documented_rows()
    for name, setting in DECLARED.items():
        assert name in rows, f"{name} is not in docs/hosting.md's tables"
        assert rows[name][0] == setting.default_text(), name
        if setting.group == "limits":
            assert rows[name][1] == setting.default_text(on_host=True), name


def test_every_documented_variable_is_declared():
    for path in GUIDES:
        named = set(re.findall(r"\bMARS_DEMO_[A-Z0-9_]*[A-Z0-9]", path.read_text(encoding="utf-8")))
        assert named <= set(DECLARED), f"{path.relative_to(ROOT)} names undeclared {sorted(named - set(DECLARED))}"


def test_the_project_reads_at_least_the_variables_it_names():
    ours = {name for name in DECLARED if name.startswith("MARS_DEMO_")}
    assert len(ours) >= 26 and all(s.doc and "\n" not in s.doc for s in DECLARED.values())


@pytest.mark.parametrize("setting", [s for s in OURS if s.kind not in FREE_TEXT], ids=lambda s: s.name)
def test_a_bad_value_is_one_line_naming_the_variable_and_what_it_accepts(setting):
    with pytest.raises(SettingError) as err:
        setting.read({setting.name: "bogus"})
    message = str(err.value)
    assert message == f"{setting.name} must be {setting.kind.accepts}, got 'bogus'"
    value, problem = setting.read_or_default({setting.name: "bogus"})
    assert value == setting.default and problem.startswith(message) and problem.endswith(setting.default_text())


@pytest.mark.parametrize("setting", list(DECLARED.values()), ids=lambda s: s.name)
def test_unset_or_empty_is_the_default(setting):
    assert setting.read({}) == setting.default == setting.read({setting.name: "  "})


def test_values_are_parsed_and_bounded():
    assert settings.RUN_SECONDS.read({"MARS_DEMO_RUN_SECONDS": "90"}) == 90.0
    assert settings.LIVE_ROWS.read({"MARS_DEMO_LIVE_ROWS": "16"}) == 16
    assert settings.MAX_NEW_TOKENS.read({"MARS_DEMO_MAX_NEW_TOKENS": "1e3"}) == 1000
    assert settings.PATHS.read({"MARS_DEMO_PATHS": " Shared "}) == "shared"
    assert settings.EXTRA_MODELS.read({"MARS_DEMO_EXTRA_MODELS": " a/b, ,c "}) == ("a/b", "c")
    assert settings.THREADS.read({"MARS_DEMO_THREADS": "Auto"}) is None
    assert settings.LEAN.read({"MARS_DEMO_LEAN": "off"}) is False and settings.LEAN.read({"MARS_DEMO_LEAN": "1"})
    for setting, bad in ((settings.LIVE_ROWS, "17"), (settings.LIVE_ROWS, "2.5"), (settings.RUN_SECONDS, "0"),
                         (settings.RUN_SECONDS, "nan"), (settings.LIVE_PACE, "1.5"), (settings.THREADS, "0"),
                         (settings.HUB_TIMEOUT, "61"), (settings.MEMORY_MARGIN_MB, "-1")):
        with pytest.raises(SettingError, match=f"^{setting.name} must be"):
            setting.read({setting.name: bad})


def test_hosted_defaults_follow_the_server():
    for env in ({"SPACE_ID": "me/mars"}, {"GRADIO_SERVER_NAME": "0.0.0.0"}):
        assert settings.hosted(env) and settings.RUN_SECONDS.read(env) == 60.0 and not settings.ANY_MODEL.read(env)
    for env in ({}, {"GRADIO_SERVER_NAME": "127.0.0.1"}, {"GRADIO_SERVER_NAME": "localhost"}):
        assert not settings.hosted(env) and settings.RUN_SECONDS.read(env) == 600.0 and settings.ANY_MODEL.read(env)
    assert settings.UPLOAD_MB.read({"SPACE_ID": "me/mars"}) == 1.0  # the same in both


def test_platform_variables_are_read_as_their_owners_read_them():
    for word in ("1", "ON", "yes", "true"):
        assert settings.HF_HUB_OFFLINE.read({"HF_HUB_OFFLINE": word})
    for word in ("0", "off", "false", "maybe"):  # huggingface_hub's rule: only 1/on/yes/true is on
        assert not settings.HF_HUB_OFFLINE.read({"HF_HUB_OFFLINE": word})
    assert settings.SPACES_ZERO_GPU.read({"SPACES_ZERO_GPU": "t"}) and not settings.SPACES_ZERO_GPU.read({"X": "1"})
    assert settings.may_install_base({"SPACE_ID": "me/mars"}) and not settings.may_install_base({})
    assert not settings.may_install_base({"SPACE_ID": "me/mars", "MARS_DEMO_INSTALL_BASE": "0"})
    assert settings.may_install_base({"MARS_DEMO_INSTALL_BASE": "yes"})


def test_a_value_is_read_at_each_call(monkeypatch):
    monkeypatch.setenv("MARS_DEMO_LIVE_QUEUE", "9")
    assert settings.LIVE_QUEUE.read() == 9 and settings.read("MARS_DEMO_LIVE_QUEUE") == 9
    monkeypatch.setenv("MARS_DEMO_LIVE_QUEUE", "2")
    assert settings.LIVE_QUEUE.read() == 2
    monkeypatch.delenv("MARS_DEMO_LIVE_QUEUE")
    assert settings.LIVE_QUEUE.read() == 4
    with pytest.raises(KeyError):
        settings.read("MARS_DEMO_NO_SUCH")


def test_the_declarations_agree_with_the_code_they_stand_for():
    from mars_demo.engine.backends.cpu.paths import PRECISIONS
    from mars_demo.engine.decoding.config import RANGES
    from mars_demo.engine.serving.shared import LIVE_POLICY

    top = int(RANGES["max_new_tokens"][1])
    assert settings.PRECISIONS == PRECISIONS and settings.LIVE_POLICY.default == LIVE_POLICY
    assert settings.MAX_NEW_TOKENS.default == settings.SWEEP_TOKENS.default == top
    assert settings.MAX_NEW_TOKENS.kind.accepts.endswith(f"to {top}")


def test_the_settings_command(monkeypatch, capsys):
    monkeypatch.setenv("MARS_DEMO_LIVE_ROWS", "99")
    monkeypatch.setenv("MARS_DEMO_MODELS", "3")
    assert main(["settings"]) == 2
    out, err = capsys.readouterr()
    lines = dict(line.split(None, 1) for line in out.splitlines())
    assert set(lines) == set(DECLARED) and lines["MARS_DEMO_MODELS"] == "3"
    assert lines["MARS_DEMO_LIVE_ROWS"] == "'99', which cannot be read" and "(the default)" in lines["MARS_DEMO_CACHE"]
    assert err.strip() == "error: MARS_DEMO_LIVE_ROWS must be a whole number from 1 to 16, got '99'; using 4"
    assert main(["settings", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert all(settings.markdown(group) in out for group in settings.GROUPS)


def test_the_settings_command_writes_the_docs_tables(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Page\n<!-- settings:engine -->\nold table\n<!-- /settings -->\nafter\n", encoding="utf-8")
    assert main(["settings", "--docs", str(page)]) == 0
    assert page.read_text(encoding="utf-8") == (
        f"# Page\n<!-- settings:engine -->\n{settings.markdown('engine')}\n<!-- /settings -->\nafter\n")
    with pytest.raises(ValueError, match="without a <!-- settings:GROUP -->"):
        settings.fill_tables("<!-- settings:nothing -->\n<!-- /settings -->")
