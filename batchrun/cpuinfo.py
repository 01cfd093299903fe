"""This CPU's model name and feature flags, from /proc/cpuinfo (empty where there is none). A bottom module: the
kernel build key, the dtype probe and the benchmarks read it."""
from __future__ import annotations

from pathlib import Path


def _field(name: str) -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    line = next((line for line in text.splitlines() if line.startswith(name)), "")
    return line.partition(":")[2].strip()


def cpu_flags() -> set[str]:
    return set(_field("flags").split())


def cpu_model() -> str:
    return _field("model name") or "unknown CPU"
