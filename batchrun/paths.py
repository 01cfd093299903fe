"""Where batchrun keeps what it builds once per machine (converted models, compiled CPU kernels). A bottom module."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("BATCHRUN_CACHE", Path.home() / ".cache" / "batchrun"))
