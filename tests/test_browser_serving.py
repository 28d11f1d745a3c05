"""The Serving tab's replay in a real browser on the bundled model: Run with the defaults (rate from this
machine's cost surface), the policies take turns pass by pass while the status line and charts update, and the
run ends with a totals row per policy.

Uses test_browser.py's fixtures (``python app.py`` on a free port, headless Chromium) and skips where they do.
Saves a screenshot to the test's temporary folder, or to MARS_DEMO_SERVING_SCREENSHOT.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from test_browser import browser, pytestmark, server  # noqa: F401 - the fixtures and skips, shared


def test_run_takes_turns_and_ends_with_every_policys_totals(browser, server, tmp_path):  # noqa: F811
    context = browser.new_context(viewport={"width": 1440, "height": 1600})
    page = context.new_page()
    try:
        page.goto(server.url)
        page.wait_for_selector("#model-status .model-status.ok", timeout=120_000)
        page.get_by_role("tab", name="Serving").click()
        page.click("#serve-run")
        statuses, deadline = [], time.monotonic() + 240
        while time.monotonic() < deadline:
            text = page.inner_text("#serve-status")
            if text and (not statuses or statuses[-1] != text):
                statuses.append(text)
            if text.startswith(("Finished", "Stopped", "Time limit")):
                break
            time.sleep(0.2)
        shot = os.environ.get("MARS_DEMO_SERVING_SCREENSHOT") or str(tmp_path / "serving.png")
        page.screenshot(path=shot, full_page=True)
        assert statuses and statuses[-1].startswith("Finished"), statuses[-3:]
        turns = [s for s in statuses if s.startswith("Policies taking turns")]
        assert turns and all(name in turns[-1] for name in ("fixed:1", "fixed:0.9", "adaptive")), statuses[:6]
        cells = [c.strip() for c in page.inner_text("#serve-totals").split("\n") if c.strip()]
        names = [c for c in cells if c in ("fixed:1", "fixed:0.9", "adaptive")]
        assert names == ["fixed:1", "fixed:0.9", "adaptive"], cells  # a row per policy, in the order asked
        assert Path(shot).is_file()
    finally:
        context.close()
