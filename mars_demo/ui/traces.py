"""The trace files behind the download buttons: one pair per session, bounded, removed with their session.

Each session keeps only its latest run (``<stem>.json`` and ``<stem>.csv``, the stem
random per session). Files go when their session ends: the tab closes (``forget_owner``
from the app's unload event, or ``forget`` from gr.State's delete callback), or, for
API sessions that never close, when they are older than ``max_age``. Every write also
drops the oldest pairs past ``max_files``. The app serves this folder in place (a
Gradio static path), so a removed file's URL stops working with it.

A TraceStore knows nothing of models: Gradio's component config may reach it
(the state's delete callback) and copies that config on every page load.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from .race import RaceTrace

SUFFIXES = (".json", ".csv")


def stem(session_id: str) -> str:
    """A session's trace file name without suffix: random per session, so not guessable."""
    return f"mars-trace-{session_id}"


class TraceStore:
    def __init__(self, directory: str | Path, *, max_files: int = 200, max_age: float = 1800.0) -> None:
        self.directory = Path(directory)
        self.max_files = max_files  # both files of a pair count
        self.max_age = max_age  # seconds a pair outlives its last write
        self._owners: dict[str, set[str]] = {}  # Gradio session hash -> stems written for it
        self._lock = threading.Lock()

    def path(self, stem: str, suffix: str) -> Path:
        return self.directory / f"{stem}{suffix}"

    def write(self, trace: RaceTrace, stem: str, owner: str | None = None) -> tuple[Path, Path]:
        """Write the pair for ``stem`` (replacing the session's previous one), then enforce the bounds."""
        with self._lock:
            if owner:
                self._owners.setdefault(owner, set()).add(stem)
            paths = trace.write(self.directory, stem)
            self._prune(keep=stem)
        return paths

    def forget(self, stem: str) -> None:
        with self._lock:
            for suffix in SUFFIXES:
                self.path(stem, suffix).unlink(missing_ok=True)

    def forget_owner(self, owner: str | None) -> None:
        """The browser session ``owner`` has ended: remove every pair written for it."""
        with self._lock:
            stems = self._owners.pop(owner or "", set())
        for stem in stems:
            self.forget(stem)

    def prune(self) -> None:
        with self._lock:
            self._prune()

    def _prune(self, keep: str | None = None) -> None:
        """Drop pairs older than ``max_age``, then the oldest past ``max_files`` (never ``keep``, just written)."""
        files = []
        for path in self.directory.glob("mars-trace-*"):
            try:
                files.append((path.stat().st_mtime, path))
            except FileNotFoundError:
                continue
        files.sort()
        too_old = time.time() - self.max_age
        excess = len(files) - self.max_files
        for mtime, path in files:
            if path.stem == keep:
                continue
            if mtime < too_old or excess > 0:
                path.unlink(missing_ok=True)
                excess -= 1
        live = {path.stem for _, path in files if path.exists()}
        for owner, stems in list(self._owners.items()):
            stems &= live
            if not stems:
                del self._owners[owner]

    def files(self) -> list[Path]:
        return sorted(self.directory.glob("mars-trace-*"))
