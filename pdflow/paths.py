"""Where pdflow keeps what it builds once per machine: converted models, packed weights, the
compiled kernels (a leaf: imports nothing of pdflow)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$PDFLOW_CACHE_DIR``, else ``~/.cache/pdflow``."""
    return Path(os.environ.get("PDFLOW_CACHE_DIR") or "~/.cache/pdflow").expanduser()
