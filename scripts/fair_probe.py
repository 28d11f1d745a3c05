"""Probe the app as a hostile but legal visitor of a public CPU Space would (issue #35), on loopback only.

Starts ``python app.py`` on 127.0.0.1 (``scripts/soak.py``'s Server: a free port, the bundled model,
offline) with ``SPACE_ID`` set, so the hosted defaults apply (docs/hosting.md), plus whatever the
host overrides are given with ``--env NAME=VALUE``. Then, as separate visitors (gradio_client sessions):

* ``maximal``: a maximal race (the most new tokens allowed, block 16, temperature 2, full window,
  a ~1000-token prompt) and, one second later, a second visitor's short race: how long the first
  held the decoding slot, and when the second one's first token arrived;
* ``cancelled_sweeps``: four sweeps from four sessions, each cancelled once the first decodes: the
  server's CPU after the last cancel, and the seconds until it is idle (under 10% of one core);
* ``bad_calls``: malformed calls on every endpoint (missing values, wrong types, NaN, huge strings):
  how many got an empty error (``{"error": null}``);
* ``memory``: the server's RSS after the first load and at the end (after a few idle seconds).

    python scripts/fair_probe.py --out /tmp/fair.json
    python scripts/fair_probe.py --env MARS_DEMO_RUN_SECONDS=10 --env MARS_DEMO_MAX_NEW_TOKENS=2048

It prints one JSON object (and writes it to ``--out``), with the CPU model from ``lscpu``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import Server, cpu_model

from mars_demo.engine.checkpoints.loading import BUNDLED
from mars_demo.ui.examples import EXAMPLE_PROMPTS
from mars_demo.ui.outputs import RACE_OUTPUTS

LOOPBACK = "127.0.0.1"
MARS_PANE = RACE_OUTPUTS.index("mars_pane")
LONG_PROMPT = " ".join(EXAMPLE_PROMPTS) * 6  # ~1000 tokens
HUGE = "x" * 200_000


def race_args(prompt: str, tokens: int, block: int = 4, temperature: float = 0.0, full: bool = False) -> list:
    return [prompt, BUNDLED, 0.9, block, tokens, "probability", temperature, full, True, "mars", "auto"]


def passes_in(output) -> int:
    """The MARS pane's pass count in one streamed output (0 when the pane was not in it)."""
    pane = output[MARS_PANE] if isinstance(output, (list, tuple)) else None
    text = pane.get("value", "") if isinstance(pane, dict) else pane or ""
    found = re.search(r'data-passes="(\d+)"', text or "")
    return int(found.group(1)) if found else 0


def maximal(url: str, tokens: int) -> dict:
    """A maximal race, and a second visitor's short one a second later: how long the first held the slot
    (submit to end), when the second's first token arrived (submit to the first pass on its stream)."""
    from gradio_client import Client

    first, second = Client(url, verbose=False), Client(url, verbose=False)
    started = time.monotonic()
    job = first.submit(*race_args(LONG_PROMPT, tokens, block=16, temperature=2.0, full=True), api_name="/run")
    time.sleep(1.0)
    asked = time.monotonic()
    other = second.submit(*race_args(EXAMPLE_PROMPTS[0], 32), api_name="/run")
    first_done = first_token = None
    while not (job.done() and other.done()):
        if first_done is None and job.done():
            first_done = time.monotonic() - started
        if first_token is None and any(passes_in(o) > 0 for o in other.outputs()):
            first_token = time.monotonic() - asked
        time.sleep(0.05)
    first_done = first_done or time.monotonic() - started
    if first_token is None and any(passes_in(o) > 0 for o in other.outputs()):
        first_token = time.monotonic() - asked
    return {"max_new_tokens": tokens, "first_run_seconds": round(first_done, 2),
            "first_run_passes": max((passes_in(o) for o in job.outputs()), default=0),
            "first_run_limit_reached": any("time limit" in json.dumps(o) for o in job.outputs()[-1:]),
            "second_first_token_seconds": round(first_token or -1, 2)}


def cancelled_sweeps(url: str, server: Server) -> dict:
    from gradio_client import Client

    jobs = []
    for _ in range(4):
        client = Client(url, verbose=False)
        jobs.append(client.submit(list(EXAMPLE_PROMPTS[:4]), [0.95, 0.9, 0.8, 0.7, 0.5], 128, BUNDLED, 4,
                                  "probability", 0.0, False, "auto", api_name="/sweep"))
    time.sleep(1.5)  # the first decodes, the others wait
    proc, idle_after, trace = psutil.Process(server.proc.pid), None, []
    proc.cpu_percent(None)
    busy = proc.cpu_percent(0.5)  # before the cancels: the first sweep is decoding
    for job in jobs:
        job.cancel()
    cancelled = time.monotonic()
    proc.cpu_percent(None)
    while time.monotonic() - cancelled < 10:
        percent = proc.cpu_percent(0.25)
        trace.append(round(percent))
        if percent < 10 and idle_after is None:
            idle_after = time.monotonic() - cancelled
        if idle_after is not None and time.monotonic() - cancelled > idle_after + 2:
            break
    return {"cpu_percent_before_cancel": round(busy), "cpu_percent_each_quarter_second_after": trace,
            "idle_after_seconds": round(idle_after or -1, 2)}


def bad_calls(url: str) -> dict:
    from gradio_client import Client

    endpoints = Client(url, verbose=False).view_api(return_format="dict", print_info=False)["named_endpoints"]
    wrong = [{"a": 1}, [1, 2], None, "NaN", float("nan"), HUGE, -1e308]
    counts = {"calls": 0, "empty_error": 0, "error_message": 0, "answered": 0, "refused_at_join": 0}
    empty = []
    for name, info in endpoints.items():
        n = len(info["parameters"])
        for data in [[], [None], *[[w] * n for w in wrong], *[[w] + ["x"] * (n - 1) for w in wrong[:2]]]:
            base = f"{url}gradio_api/call{name}"
            counts["calls"] += 1
            joined = httpx.post(base, content=json.dumps({"data": data}), timeout=30,
                                headers={"content-type": "application/json"})
            if joined.status_code != 200:
                counts["refused_at_join"] += 1
                continue
            stream = httpx.get(f"{base}/{joined.json()['event_id']}", timeout=120).text
            if "event: error" in stream:
                payload = stream.split("event: error", 1)[1].split("data: ", 1)[1].splitlines()[0]
                if json.loads(payload).get("error"):
                    counts["error_message"] += 1
                else:
                    counts["empty_error"] += 1
                    empty.append(name)
            else:
                counts["answered"] += 1
    return {**counts, "empty_error_endpoints": sorted(set(empty))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the server (a host override)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="the maximal race's tokens (default: MARS_DEMO_MAX_NEW_TOKENS, else the hosted 512)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    env = {"SPACE_ID": "probe/mars-demo", **dict(item.split("=", 1) for item in args.env)}
    if env.get("GRADIO_SERVER_NAME", LOOPBACK) != LOOPBACK:
        parser.error("the probe only ever targets loopback")
    root = Path(__file__).resolve().parent.parent
    server = Server(root, env, sample=0.5, max_rss=8.0, log=Path(tempfile.gettempdir()) / "fair_probe_server.log")
    tokens = args.max_new_tokens or int(env.get("MARS_DEMO_MAX_NEW_TOKENS", "512"))
    try:
        server.wait_ready()
        from gradio_client import Client

        Client(server.url, verbose=False).predict(*race_args(EXAMPLE_PROMPTS[0], 8), api_name="/run")  # first load
        time.sleep(2.0)
        report = {"cpu": cpu_model(), "cores": psutil.cpu_count(), "env": env, "rss_mb_after_first_load":
                  round(server.rss(), 1)}
        report["maximal"] = maximal(server.url, tokens)
        report["cancelled_sweeps"] = cancelled_sweeps(server.url, server)
        report["bad_calls"] = bad_calls(server.url)
        time.sleep(6.0)  # idle: the heap trim after the last run (MARS_DEMO_MALLOC_TRIM) has happened
        report["rss_mb_at_end"] = round(server.rss(), 1)
        report["rss_mb_growth"] = round(report["rss_mb_at_end"] - report["rss_mb_after_first_load"], 1)
    finally:
        server.stop()
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
