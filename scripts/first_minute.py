"""The first minute, measured as a visitor sees it: ``python app.py`` on a cache folder, Chromium opens the page.

Prints (and writes as JSON with ``--out``) the seconds from the page's first load to the model line
turning ready (``#model-status .model-status.ok``), every status text shown on the way, and, after
Run on the robot story, the seconds to the race's first MARS pass and to its end; ``--screenshot``
saves the page once the race is done. An empty ``--cache`` folder is a first start; run it again on
the same folder for a warm one. Needs Chromium (Debian's ``chromium``) and Playwright.

    python scripts/first_minute.py --cache /tmp/fresh-cache --out first.json --screenshot race.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from test_browser import CHROMIUM_ARGS, chromium_path, free_port  # one definition of the browser

PROMPT = "Write a short story about a robot who learns to paint."


def serve(cache: Path, port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port),
           "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1", "MARS_DEMO_CACHE": str(cache)}
    proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"app.py exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return proc
        except OSError:
            time.sleep(0.2)


def measure(page, url: str, tokens: int, mode: str | None) -> dict:
    started = time.monotonic()
    page.goto(url)
    seen: list[tuple[float, str]] = []
    while not page.locator("#model-status .model-status.ok").count():
        text = page.locator("#model-status").inner_text().strip()
        if text and (not seen or seen[-1][1] != text):
            seen.append((round(time.monotonic() - started, 1), text))
        time.sleep(0.1)
    ready = time.monotonic() - started
    page.locator("#max-new-tokens input[type=number]").fill(str(tokens))
    page.fill("#prompt textarea", PROMPT)
    if mode:
        page.get_by_label(mode).check()  # a decoding mode by its label, e.g. "Exact (verified)"
    clicked = time.monotonic()
    page.click("#run")
    page.wait_for_function("Number(document.querySelector('#mars-pane .pane').dataset.passes) >= 1", timeout=120_000)
    first = time.monotonic()
    page.wait_for_selector("#mars-pane .pane[data-status=done]", timeout=300_000)
    page.wait_for_selector("#ar-pane .pane[data-status=done]", timeout=300_000)
    return {"ready_s": round(ready, 2), "first_pass_s": round(first - started, 2),
            "first_pass_after_run_s": round(first - clicked, 2), "race_done_s": round(time.monotonic() - started, 2),
            "status_lines": seen, "model_line": page.locator("#model-status").inner_text().strip()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, required=True, help="MARS_DEMO_CACHE for the app (empty: a first start)")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--screenshot", type=Path)
    parser.add_argument("--mode", help='the race\'s decoding mode by its label, e.g. "Exact (verified)"')
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    port, log = free_port(), args.cache.with_name(args.cache.name + ".app.log")
    proc = serve(args.cache, port, log)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1440, "height": 1500})
            result = measure(page, f"http://127.0.0.1:{port}/", args.tokens, args.mode)
            if args.screenshot:
                page.screenshot(path=str(args.screenshot), full_page=False)
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
