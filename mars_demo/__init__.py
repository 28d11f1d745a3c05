"""mars-demo: MARS multi-token generation (arXiv 2604.07023), its decoders, training and demo."""

from __future__ import annotations

__version__ = "0.1.0"
