"""A bounded localhost soak of the app: page loads, then N API sessions mixing runs, stops, reloads, tau drags, sweeps.

Starts ``python app.py`` from ``--app-dir`` on a free port (the bundled model, offline),
samples the server's memory (RSS) every ``--sample`` seconds, and writes one JSON
report. Two phases:

* ``pageload``: with the model loaded, sequential GET /config and GET / (time each,
  memory after), then ``--parallel`` simultaneous GET / (memory before and after).
  A watchdog stops the server if its memory passes ``--max-rss-gb`` (the old app copied
  the model per page load).
* ``soak`` (``--sessions`` > 0): each session is a gradio_client Client with its own
  tau; it loops over actions (run, run + stop, run + tau drag, reload = a new Client,
  sweep) until ``--runs`` runs are done or ``--minutes`` pass. Every run's trace is
  downloaded and checked: complete (status done, passes numbered 1..n, tokens add up)
  or stopped, and every pass at this session's tau (or the tau it dragged to).

    python scripts/soak.py --sessions 4 --runs 200 --max-new-tokens 12 --out docs/soak.json
    python scripts/soak.py --sessions 0 --app-dir /tmp/old-checkout --out /tmp/before.json   # page loads only
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from mars_demo.ui.examples import EXAMPLE_PROMPTS as PROMPTS
from mars_demo.ui.outputs import RACE_OUTPUTS

JSON_FILE = RACE_OUTPUTS.index("json_file")  # the API's outputs come by position


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python app.py`` in ``app_dir``; its RSS sampled in a thread, stopped past ``max_rss``."""

    def __init__(self, app_dir: Path, env: dict, sample: float, max_rss: float, log: Path) -> None:
        self.port = free_port()
        self.scratch = Path(tempfile.mkdtemp(prefix="mars-soak-"))  # traces and downloads, removed at the end
        self.traces = self.scratch / "traces"
        self.url = f"http://127.0.0.1:{self.port}/"
        env = {**os.environ, **env, "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(self.port),
               "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1",
               "MARS_DEMO_TRACE_DIR": str(self.traces)}
        self.log = open(log, "w")  # noqa: SIM115 - the server writes to it until stop() closes it
        self.proc = subprocess.Popen([sys.executable, "app.py"], cwd=app_dir, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        self.ps = psutil.Process(self.proc.pid)
        self.samples: list[tuple[float, float]] = []  # (seconds since start, RSS MB)
        self.started = time.monotonic()
        self.max_rss, self.sample_every, self.killed = max_rss, sample, False
        self._stop = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def rss(self) -> float:
        return self.ps.memory_info().rss / 2**20

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                mb = self.rss()
            except psutil.Error:
                return
            self.samples.append((round(time.monotonic() - self.started, 1), round(mb, 1)))
            if mb > self.max_rss * 1024:
                self.killed = True
                self.proc.kill()
                return
            self._stop.wait(self.sample_every)

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"app.py exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "config", timeout=5):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("app.py did not answer")

    def stop(self) -> None:
        self._stop.set()
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


def timed_get(url: str, timeout: float = 120) -> float:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=timeout) as response:
        response.read()
    return round(time.perf_counter() - started, 4)


def page_loads(server: Server, repeat: int, parallel: int) -> dict:
    out: dict = {"rss_mb_model_loaded": round(server.rss(), 1)}
    for path in ("config", ""):
        times, rss = [], []
        for _ in range(repeat):
            times.append(timed_get(server.url + path))
            rss.append(round(server.rss(), 1))
        out[f"GET /{path}"] = {"seconds": times, "rss_mb_after": rss}
    before = server.rss()
    with ThreadPoolExecutor(parallel) as pool:
        times = list(pool.map(lambda _: timed_get(server.url), range(parallel)))
    time.sleep(1)
    out[f"{parallel} parallel GET /"] = {
        "seconds": times, "rss_mb_before": round(before, 1), "rss_mb_after": round(server.rss(), 1),
        "rss_mb_peak": max(mb for _, mb in server.samples),
    }
    return out


# -- the soak ----------------------------------------------------------------------------------
def settings(tau: float, max_new_tokens: int) -> list:
    # model, tau, block size, max new tokens, metric, temperature, full window, with AR
    return ["smollm2-135m-mars", tau, 4, max_new_tokens, "probability", 0.0, False, True]


def check_trace(path: str, tau: float, dragged: float | None, stopped: bool) -> list[str]:
    """What is wrong with one run's downloaded trace (an empty list: nothing)."""
    trace = json.loads(Path(path).read_text(encoding="utf-8"))
    problems = []
    want = "stopped" if stopped else "done"
    if trace["status"] != want and not (stopped and trace["status"] == "done"):  # a stop may come too late
        problems.append(f"status {trace['status']}, expected {want}")
    if trace["config"]["tau"] != tau:
        problems.append(f"config tau {trace['config']['tau']} != {tau}")
    allowed = {tau} | ({dragged} if dragged is not None else set())
    for side, data in trace["sides"].items():
        passes = data["passes"]
        if [p["pass"] for p in passes] != list(range(1, len(passes) + 1)):
            problems.append(f"{side}: passes not numbered 1..n")
        if sum(p["tokens"] for p in passes) != data["tokens"]:
            problems.append(f"{side}: tokens do not add up")
        if trace["status"] == "done" and not data["finish_reason"]:
            problems.append(f"{side}: done without a finish reason")
        if side == "mars":
            taus = [p["tau"] for p in passes]
            if not set(taus) <= allowed or (taus and taus[0] != tau):
                problems.append(f"cross-talk: taus {sorted(set(taus))} not within {sorted(allowed)}")
    return problems


class Soak:
    def __init__(self, server: Server, args) -> None:
        self.server, self.args = server, args
        self.lock = threading.Lock()
        self.runs = 0
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.actions: Counter = Counter()
        self.errors: list[str] = []
        self.problems: list[str] = []
        self.trace_files: list[tuple[float, int]] = []
        self.deadline = time.monotonic() + args.minutes * 60
        self.downloads = server.scratch / "downloads"
        self.rss_warm: tuple[float, float] | None = None  # (seconds, RSS MB) once --warmup-runs runs are done

    def more(self) -> bool:
        with self.lock:
            return self.runs < self.args.runs and time.monotonic() < self.deadline and not self.server.killed

    def client(self):
        from gradio_client import Client

        started = time.perf_counter()
        client = Client(self.server.url, verbose=False, download_files=str(self.downloads))
        self.record("connect", started)
        return client

    def record(self, what: str, started: float) -> None:
        with self.lock:
            self.latency[what].append(round(time.perf_counter() - started, 3))

    def session(self, index: int) -> None:
        rng = random.Random(index)
        tau = round(0.5 + 0.07 * index, 2)  # every session its own tau: a pass at another's is cross-talk
        client = self.client()
        while self.more():
            action = rng.choices(list(self.args.mix), list(self.args.mix.values()))[0]
            try:
                if action == "reload":
                    client = self.client()
                elif action == "sweep":
                    started = time.perf_counter()
                    # prompts, taus, max new tokens, model, block size, metric, temperature, full window
                    client.predict([rng.choice(PROMPTS)], [0.7], 8, "smollm2-135m-mars", 4, "probability", 0.0, False,
                                   api_name="/sweep")
                    self.record("sweep", started)
                else:
                    self.race(client, tau, action, rng)
                with self.lock:
                    self.actions[action] += 1
            except Exception as err:  # noqa: BLE001 - every failure is a finding
                with self.lock:
                    self.errors.append(f"session {index} {action}: {type(err).__name__}: {str(err)[:200]}")

    def race(self, client, tau: float, action: str, rng: random.Random) -> None:
        started = time.perf_counter()
        job = client.submit(rng.choice(PROMPTS), *settings(tau, self.args.max_new_tokens), api_name="/run")
        dragged = None
        if action in ("stop", "drag"):
            while len(job.outputs()) < 3 and not job.done():
                time.sleep(0.02)
            if action == "drag":
                dragged = round(tau - 0.3, 2)
                client.predict(dragged, api_name="/set_tau")
            else:
                outputs = client.predict(api_name="/stop")
        result = job.result(timeout=300)
        if action == "stop" and isinstance(outputs[JSON_FILE], dict) and outputs[JSON_FILE].get("value"):
            result = outputs  # the stopped run's files come from Stop
        self.record(action, started)
        with self.lock:
            self.runs += 1
            if self.runs == self.args.warmup_runs:
                self.rss_warm = (round(time.monotonic() - self.server.started, 1), round(self.server.rss(), 1))
        files = result[JSON_FILE]
        if not (isinstance(files, dict) and files.get("value")):
            if action == "stop":
                return  # stopped before its first pass: nothing to download
            raise RuntimeError(f"no trace file: {files!r}"[:200])
        problems = check_trace(files["value"], tau, dragged, action == "stop")
        with self.lock:
            self.problems += [f"{action} at tau {tau}: {p}" for p in problems]

    def watch_traces(self, directory: Path) -> None:
        while self.more():
            self.trace_files.append((round(time.monotonic() - self.server.started, 1),
                                     len(list(directory.glob("mars-trace-*")))))
            time.sleep(1)

    def run(self) -> dict:
        trace_dir = self.server.traces
        threading.Thread(target=self.watch_traces, args=(trace_dir,), daemon=True).start()
        started = time.monotonic()
        with ThreadPoolExecutor(self.args.sessions) as pool:
            list(pool.map(self.session, range(self.args.sessions)))
        warm_t, warm_mb = self.rss_warm or (None, None)
        after = [mb for t, mb in self.server.samples if warm_t is not None and t >= warm_t]
        end_mb = round(self.server.rss(), 1)
        return {
            "rss_mb_warm": warm_mb,
            "rss_mb_end": end_mb,
            "rss_mb_growth_after_warmup": round(end_mb - warm_mb, 1) if warm_mb else None,
            "rss_mb_range_after_warmup": [min(after), max(after)] if after else None,
            "seconds": round(time.monotonic() - started, 1),
            "runs": self.runs,
            "actions": dict(self.actions),
            "errors": self.errors,
            "trace_problems": self.problems,
            "latency_s": {k: summary(v) for k, v in self.latency.items()},
            "trace_files_max": max((n for _, n in self.trace_files), default=0),
            "trace_files": self.trace_files[:: max(1, len(self.trace_files) // 60)],
        }


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return "unknown"
    names = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")]
    return names[0] if names else "unknown"


def summary(values: list[float]) -> dict:
    values = sorted(values)
    return {"n": len(values), "median": statistics.median(values), "p95": values[int(0.95 * (len(values) - 1))],
            "max": values[-1]}


MIX = "run=50,stop=15,drag=20,reload=10,sweep=5"


def parse_mix(text: str) -> dict[str, float]:
    mix = {name: float(weight) for name, weight in (part.split("=") for part in text.split(","))}
    unknown = set(mix) - {"run", "stop", "drag", "reload", "sweep"}
    if unknown or not any(mix.get(a) for a in ("run", "stop", "drag")):
        raise argparse.ArgumentTypeError(f"actions are run, stop, drag, reload, sweep (one run kind at least): {text}")
    return mix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--app-dir", type=Path, default=ROOT)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--minutes", type=float, default=8.0)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--warmup-runs", type=int, default=20, help="runs before memory counts as warmed up")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=5, help="sequential GET /config and GET /")
    parser.add_argument("--parallel", type=int, default=10, help="simultaneous GET /")
    parser.add_argument("--sample", type=float, default=1.0, help="seconds between memory samples")
    parser.add_argument("--max-rss-gb", type=float, default=10.0, help="stop the server past this much memory")
    parser.add_argument("--trace-files", type=int, default=24, help="the app's MARS_DEMO_TRACE_FILES")
    parser.add_argument("--mix", type=parse_mix, default=parse_mix(MIX),
                        help=f"action weights (default {MIX}); reload = a new session")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    log = args.out.with_suffix(".log")
    env = {"MARS_DEMO_TRACE_FILES": str(args.trace_files), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    server = Server(args.app_dir, env, args.sample, args.max_rss_gb, log)
    report: dict = {"app_dir": str(args.app_dir), "args": {k: str(v) for k, v in vars(args).items()},
                    "malloc_arena_max": os.environ.get("MALLOC_ARENA_MAX"),
                    "malloc_trim": os.environ.get("MARS_DEMO_MALLOC_TRIM", "default (5 s)"),
                    "cpu": cpu_model()}
    try:
        server.wait_ready()
        report["rss_mb_idle"] = round(server.rss(), 1)
        soak = Soak(server, argparse.Namespace(**{**vars(args), "runs": 1}))
        soak.race(soak.client(), 0.9, "run", random.Random(0))  # loads the model
        report["page_loads"] = page_loads(server, args.repeat, args.parallel)
        if args.sessions:
            warm = server.rss()
            report["soak"] = Soak(server, args).run()
            report["soak"]["rss_mb_after_page_loads"] = round(warm, 1)
    finally:
        report["killed_for_memory"] = server.killed
        report["rss_samples_mb"] = server.samples
        server.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "rss_samples_mb"}, indent=1)[:6000])


if __name__ == "__main__":
    main()
