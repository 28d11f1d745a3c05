"""The Serving tab's live shared batch in a real browser: two visitors (two Chromium pages, two sessions) send on
the bundled model, the second while the first decodes; both stream, each only their own text, and tau drops while
both decode.

Uses test_browser.py's fixtures (``python app.py`` on a free port, headless Chromium) and skips where they do.
Saves a screenshot of each page to the test's temporary folder, or beside the path in
MARS_DEMO_LIVE_SCREENSHOT (``-a.png`` / ``-b.png``).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from test_browser import browser, pytestmark, server  # noqa: F401 - the fixtures and skips, shared

# two answers that run to the token limit (80-90 passes each, at least 0.05 s a pass on the test server): the two
# share the batch for most of the first one's passes, however slowly the pages are read
PROMPTS = ("Write a short poem about the sea <b>bold</b>.", "Tell me a long story about a dragon who learns to fly.")
TIPS = "[...document.querySelectorAll('#live-pane .tok')].map(e => e.dataset.tip)"


def open_live(browser, url: str):  # noqa: F811 - the fixture's name, passed in
    context = browser.new_context(viewport={"width": 1440, "height": 1100})
    page = context.new_page()
    page.goto(url)
    page.wait_for_selector("#model-status .model-status.ok", timeout=120_000)
    page.get_by_role("tab", name="Serving").click()
    page.wait_for_selector("#live-prompt textarea", timeout=10_000)
    return context, page


def sample(page) -> tuple[int, str]:
    return int(page.get_attribute("#live-pane .pane", "data-passes")), page.inner_text("#live-status")


def test_two_visitors_share_the_batch_and_tau_drops_while_both_run(browser, server, tmp_path):  # noqa: F811
    opened = [open_live(browser, server.url) for _ in PROMPTS]
    pages = [page for _, page in opened]
    try:
        for page, prompt in zip(pages, PROMPTS):
            page.fill("#live-prompt textarea", prompt)
        # the second visitor sends once the first one is in the shared batch (waiting for its first pass or
        # decoding): clicked together, the second answer once ended before the first began in a CI run; sent once
        # the first decoded, a short second answer once began and ended between two readings of the pages
        # (MARS_DEMO_LIVE_PACE, test_browser.py)
        pages[0].click("#live-send")
        first_sent_by = time.monotonic() + 120
        while not sample(pages[0])[1].startswith(("Waiting", "Decoding")) and time.monotonic() < first_sent_by:
            time.sleep(0.1)
        pages[1].click("#live-send")
        seen, deadline = [], time.monotonic() + 240
        while time.monotonic() < deadline:
            now = [sample(page) for page in pages]
            seen.append(now)
            if all(status.startswith(("Done", "Stopped", "Ended")) for _, status in now):
                break
            time.sleep(0.3)
        statuses = [status for _, status in seen[-1]]
        assert all(s.startswith("Done") for s in statuses), statuses
        both = [s for s in seen if all(p > 0 and "2 request(s) decoding" in st for p, st in s)]
        assert both, seen[:5]  # a moment when both pages streamed from one batch of two
        grew = [[p for p, _ in (s[k] for s in seen)] for k in range(2)]
        assert all(len(set(g)) > 2 for g in grew)  # each pane grew pass by pass, not all at once
        texts = [page.inner_text("#live-pane .text") for page in pages]
        assert texts[0] != texts[1] and all(len(t) > 20 for t in texts)
        for page in pages:
            taus = {float(m.group(1)) for tip in page.evaluate(TIPS) if (m := re.search(r"tau ([\d.]+)", tip))}
            assert 0.9 in taus, taus  # the passes both shared: the live policy's tau for two requests
            chart = page.evaluate("document.querySelector('#live-plot .js-plotly-plot').data[1].y")
            assert 0.9 in chart
            assert page.locator("#live-pane .text :is(script, b, img)").count() == 0
        for k, page in enumerate(pages):
            base = os.environ.get("MARS_DEMO_LIVE_SCREENSHOT")
            shot = Path(f"{base[:-4]}-{'ab'[k]}.png") if base else tmp_path / f"live-{'ab'[k]}.png"
            shot.parent.mkdir(parents=True, exist_ok=True)
            page.locator("#live-intro").scroll_into_view_if_needed()
            page.screenshot(path=str(shot), full_page=True)
        print("samples (passes, status) per page:", seen[:: max(len(seen) // 12, 1)])
    finally:
        for context, _ in opened:
            context.close()
