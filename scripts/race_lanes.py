"""What the app's own work costs each lane of the race (issue #15): ms per forward pass, MARS and AR.

Three ways to decode the same prompts with the same settings, each reading the passes'
own clocks (``StepEvent.seconds``: one forward pass each, nothing else):

* ``engine``: ``race.interleave`` of the two decoders, as the app runs them, with no UI;
* ``handler``: the app's run handler in this process (panes and figures built, no server,
  no browser), plus the time the handler spends between passes, by the side just decoded;
* ``browser``: ``python app.py`` on a free port driven by headless Chromium (Playwright),
  the traces read back from the app's trace folder; with the CPU seconds the app and
  Chromium used while the races ran.

Run it with nothing else on the CPU (``flock /tmp/cpu.lock``); BENCHMARKS.md, "The UI's cost
per lane", has the figures::

    MARS_DEMO_PRECISION=int8 PYTHONPATH=. python scripts/race_lanes.py --ways engine,handler,browser \\
        --prompts 8 --max-new-tokens 96 --out runs/race-lanes.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "assets" / "data" / "heldout_varied32.json"
WARM_UP = "Write a short poem about the sea."  # a race before the measured ones, not counted
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def lane_figures(passes: dict[str, list[list[float]]]) -> dict:
    """Per side: passes, mean and median ms per pass after each prompt's prefill (its pass 1), and MARS / AR."""
    out = {}
    for side, runs in passes.items():
        seconds = [s for run in runs for s in run]
        decode = [s * 1000 for run in runs for s in run[1:]] or [0.0]
        trimmed = sorted(decode)[len(decode) // 20 : len(decode) - len(decode) // 20] or decode
        out[side] = {"passes": len(seconds), "mean_ms": round(statistics.fmean(decode), 1),
                     "median_ms": round(statistics.median(decode), 1),
                     "trimmed_mean_ms": round(statistics.fmean(trimmed), 1)}  # the top and bottom 5% left out
    if out.get("ar", {}).get("mean_ms"):
        out["mars_over_ar"] = round(out["mars"]["mean_ms"] / out["ar"]["mean_ms"], 3)
        out["mars_over_ar_median"] = round(out["mars"]["median_ms"] / out["ar"]["median_ms"], 3)
    out["ms"] = {side: [[round(s * 1000, 2) for s in run] for run in runs] for side, runs in passes.items()}
    return out


def _settings(args):
    from mars_demo.engine.decoding.config import DecodeConfig

    return DecodeConfig(tau=args.tau, max_new_tokens=args.max_new_tokens)


def way_engine(args, prompts: list[str]) -> dict:
    from mars_demo.engine.checkpoints.loading import load_for_decoding
    from mars_demo.engine.decoding.loop import generate
    from mars_demo.ui.race import interleave

    lm = load_for_decoding(None, args.precision)
    config = _settings(args)
    passes = {"mars": [], "ar": []}
    for number, prompt in enumerate([WARM_UP, *prompts]):
        run = {"mars": [], "ar": []}
        for side, event in interleave(generate(lm, prompt, config), generate(lm, prompt, config.with_(mode="ar"))):
            run[side].append(event.seconds)
        for side in passes:
            passes[side] += [run[side]] if number else []  # the warm-up race is not counted
    return {"compute": lm.compute.summary(), **lane_figures(passes)}


def way_handler(args, prompts: list[str]) -> dict:
    from mars_demo.engine.checkpoints.loading import load_for_decoding
    from mars_demo.ui.handlers import DemoHandlers
    from mars_demo.ui.race import Session

    handlers = DemoHandlers(lambda spec, precision=None: load_for_decoding(spec, precision), guard=None,
                            trace_dir=tempfile.mkdtemp())
    passes, between = {"mars": [], "ar": []}, {"mars": [], "ar": []}
    for number, prompt in enumerate([WARM_UP, *prompts]):
        session = Session()
        run = handlers.run(prompt, None, args.tau, 4, args.max_new_tokens, "probability", 0.0, False, True, session,
                           "mars", args.precision)
        _pass_ended[:] = [0.0, None]
        for _ in run:  # each yield follows one pass: the handler's own work from that pass's end to the yield
            ended, side = _pass_ended
            if side is not None:
                between[side].append(time.perf_counter() - ended)
                _pass_ended[1] = None
        for side in passes:
            passes[side] += [[s.seconds for s in getattr(session.trace, side)]] if number else []
            between[side] = between[side] if number else []
    figures = lane_figures(passes)
    for side, values in between.items():
        figures[side]["handler_ms_after_pass"] = round(statistics.fmean(values) * 1000, 2) if values else None
    return figures


_pass_ended: list = [0.0, None]  # when the last pass ended, and its side


def _patch_interleave() -> None:
    """Note when each pass ends and which, so the handler's work after it can be timed."""
    from mars_demo.ui import handlers, race

    original = race.interleave

    def timed(mars, ar):
        for side, event in original(mars, ar):
            _pass_ended[:] = [time.perf_counter(), side]
            yield side, event

    handlers.interleave = timed


def _cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return total


def _tree(pid: int) -> list[int]:
    found, stack = [], [pid]
    while stack:
        p = stack.pop()
        found.append(p)
        try:
            stack += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            pass
    return found


def _serve(args, traces: Path, log) -> tuple[subprocess.Popen, str]:
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port),
           "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1", "MARS_DEMO_TRACE_DIR": str(traces),
           "MARS_DEMO_PRECISION": args.precision}
    proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    for _ in range(240):
        try:
            with urllib.request.urlopen(url, timeout=2):
                return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("app.py did not answer")


def way_browser(args, prompts: list[str]) -> dict:
    from playwright.sync_api import sync_playwright

    traces = Path(tempfile.mkdtemp())
    with open(traces / "app.log", "w") as log:
        proc, url = _serve(args, traces, log)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            page.goto(url)
            page.wait_for_selector("#model-status .model-status.ok", timeout=120_000)
            compute = page.inner_text("#model-status")
            box = page.locator("#max-new-tokens input[type=number]")
            box.fill(str(args.max_new_tokens))
            box.press("Enter")
            passes, cpu_app, cpu_browser, wall = {"mars": [], "ar": []}, 0.0, 0.0, 0.0
            _browser_race(page, traces, WARM_UP)  # not counted: the app's first passes of each shape
            for prompt in prompts:
                app_before, browser_before = _cpu_seconds(_tree(proc.pid)), _cpu_seconds(_chromium_pids())
                started = time.perf_counter()
                page.fill("#prompt textarea", prompt)
                page.click("#run")
                trace = _wait_for_trace(traces, prompt)
                wall += time.perf_counter() - started
                cpu_app += _cpu_seconds(_tree(proc.pid)) - app_before
                cpu_browser += _cpu_seconds(_chromium_pids()) - browser_before
                for side in passes:
                    passes[side] += [[p["seconds"] for p in trace["sides"][side]["passes"]]]
                page.wait_for_function("!document.querySelector('#download-json').disabled", timeout=30_000)
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    return {"compute": compute, **lane_figures(passes), "wall_s": round(wall, 1), "cpu_s_app": round(cpu_app, 1),
            "cpu_s_chromium": round(cpu_browser, 1)}


def _browser_race(page, traces: Path, prompt: str) -> dict:
    page.fill("#prompt textarea", prompt)
    page.click("#run")
    trace = _wait_for_trace(traces, prompt)
    page.wait_for_function("!document.querySelector('#download-json').disabled", timeout=30_000)
    return trace


def _wait_for_trace(traces: Path, prompt: str, timeout: float = 600) -> dict:
    """The trace the app writes when this prompt's race ends (its files are written at the end)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for file in traces.glob("mars-trace-*.json"):
            try:
                trace = json.loads(file.read_text())
            except (OSError, ValueError):
                continue  # being written
            if trace["prompt"] == prompt and trace["status"] == "done":
                file.unlink()
                return trace
        time.sleep(0.05)
    raise SystemExit(f"no trace for {prompt[:40]!r}")


def _chromium_pids() -> list[int]:
    """Chromium's processes: children of Playwright's driver, which is a child of this process."""
    return [p for p in _tree(os.getpid()) if "chrom" in _comm(p)]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip().lower()
    except OSError:
        return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ways", default="engine,handler,browser")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--tau", type=float, default=0.9)
    parser.add_argument("--precision", default=os.environ.get("MARS_DEMO_PRECISION", "int8"))
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    prompts = json.loads(PROMPTS.read_text())[: args.prompts]
    _patch_interleave()
    ways = {"engine": way_engine, "handler": way_handler, "browser": way_browser}
    results = {"cpu": _cpu_model(), "threads": _threads(), "settings": vars(args) | {"out": str(args.out)}}
    for name in args.ways.split(","):
        started = time.perf_counter()
        results[name] = ways[name](args, prompts)
        results[name]["seconds"] = round(time.perf_counter() - started, 1)
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "ms"}), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")


def _cpu_model() -> str:
    from mars_demo.engine.backends.cpu.paths import cpu_model

    return cpu_model()


def _threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    main()
