"""Every message the app shows in a toast: built here, once, as plain text, then fitted to the client.

The browser renders toast text as HTML, so there it is escaped; an API client gets
the plain text (no ``&#x27;``). A request from a browser carries the Fetch metadata
headers (``Sec-Fetch-Mode``) and gradio_client marks its own (``x-gradio-user: api``);
without a request (a direct call, a test) the text is escaped, the safe side.
Sentences end with exactly one full stop, whatever the parts ended with.
"""

from __future__ import annotations

import math
from html import escape

import gradio as gr


def is_api(request: gr.Request | None) -> bool:
    if request is None:
        return False
    headers = request.headers
    return headers.get("x-gradio-user") == "api" or "sec-fetch-mode" not in headers


def sentence(*parts: str) -> str:
    """Sentences joined, each ending with exactly one full stop (none doubled)."""
    return " ".join(p.strip().rstrip(".") + "." for p in parts if p and p.strip())


def for_client(text: str, request: gr.Request | None) -> str:
    return text if is_api(request) else escape(text)


def error(text: str, title: str, request: gr.Request | None = None) -> gr.Error:
    """A gr.Error to raise; ``title`` is the toast's title in the browser and the error's title for the API."""
    return gr.Error(for_client(text, request), title=title)


def warning(text: str, title: str, request: gr.Request | None = None) -> None:
    gr.Warning(for_client(text, request), title=title)


def number(value, label: str, low: float, high: float, integer: bool = False) -> float:
    """``value`` as a finite number from ``low`` to ``high`` (a whole one if ``integer``), or a ValueError (a
    TypeError for another type) whose sentence names ``label`` and the range, never the value (it may be huge)."""
    kind = "a whole number" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"{label} must be {kind} from {low:g} to {high:g}")
    try:
        number = float(value)
    except (ValueError, OverflowError):
        raise ValueError(f"{label} must be {kind} from {low:g} to {high:g}") from None
    if not (math.isfinite(number) and low <= number <= high) or (integer and number != int(number)):
        raise ValueError(f"{label} must be {kind} from {low:g} to {high:g}")
    return int(number) if integer else number


def text(value, label: str, limit: int) -> str:
    """``value`` as a string of at most ``limit`` characters, or a ValueError naming ``label``."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TypeError(f"{label} must be text")
    if len(value) > limit:
        raise ValueError(f"{label} is {len(value)} characters; this server takes at most {limit}")
    return value
