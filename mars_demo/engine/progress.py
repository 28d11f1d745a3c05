"""What a long step (a model load) is doing now, told to whoever listens in this thread: the app's status line.

The engine names its stages with ``report`` (converting the weights, building the kernels, measuring
a compute path); a caller that wants them runs the work inside ``listening``. Without a listener a
report is a log line only. The listener belongs to the calling thread's context, so two loads in two
threads each hear their own stages.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

logger = logging.getLogger(__name__)

_listener: ContextVar[Callable[[str], None] | None] = ContextVar("mars_demo_progress", default=None)


def report(stage: str) -> None:
    """Say what the work is doing now, e.g. "measuring int8dyn (compute path 1 of 4)"."""
    logger.info("%s", stage)
    listener = _listener.get()
    if listener is not None:
        listener(stage)


@contextmanager
def listening(callback: Callable[[str], None]) -> Iterator[None]:
    """Pass every ``report`` made in this context to ``callback`` until the block ends."""
    token = _listener.set(callback)
    try:
        yield
    finally:
        _listener.reset(token)
