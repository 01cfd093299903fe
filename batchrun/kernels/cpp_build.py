"""Builds a C++ kernel module once per machine with the system C++ compiler (torch's cpp_extension), cached under
BATCHRUN_CACHE/cpu_kernels, keyed by the sources, torch's version and this CPU's flags (it is compiled with
-march=native and the CPU_CAPABILITY macro that selects at::vec's AVX-512 or AVX2 code). Where no compiler is found
or the build fails, `load` returns None and says why in the log; BATCHRUN_CPU_KERNELS=0 turns every kernel off."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

import torch

from batchrun.cpuinfo import cpu_flags
from batchrun.paths import cache_dir

log = logging.getLogger("batchrun")


def _build_dir(sources: list[Path]) -> Path:
    source = b"".join(path.read_bytes() for path in sources)
    flags = " ".join(sorted(cpu_flags()))
    key = hashlib.sha256(source + torch.__version__.encode() + flags.encode()).hexdigest()[:16]
    return cache_dir() / "cpu_kernels" / key


def _vector_flags() -> list[str]:
    """The macros that select ATen's vector code (at::vec) as PyTorch's own kernels are built: AVX-512 where the
    CPU has the subsets PyTorch requires for it, else AVX2. Without them at::vec is a scalar fallback."""
    flags = cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    if {"avx2", "fma"} <= flags:
        return ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return []


def load(name: str, sources: list[Path], label: str, fallback: str):
    """The compiled module `name` (sources[0] the .cpp, the rest headers it includes), or None (no compiler,
    failed build, or turned off); `label` names the kernel in the log, `fallback` what runs instead."""
    if os.environ.get("BATCHRUN_CPU_KERNELS", "1") == "0":
        log.info("%s: off (BATCHRUN_CPU_KERNELS=0); using %s", label, fallback)
        return None
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        log.warning("%s: no C++ compiler found; using %s", label, fallback)
        return None
    from torch.utils import cpp_extension
    build = _build_dir(sources)
    build.mkdir(parents=True, exist_ok=True)
    if not any(build.glob("*.so")):
        log.info("%s: building once into %s (about a minute)", label, build)
    # Build from a copy in the (content-keyed) build directory: ninja records the source's path, so building from
    # the checkout made every other checkout of the same source (a worktree, a Ray worker's copy) rebuild.
    for path in sources:
        if not (build / path.name).exists():
            shutil.copyfile(path, build / path.name)
    try:
        return cpp_extension.load(name=name, sources=[str(build / sources[0].name)], build_directory=str(build),
                                  extra_cflags=["-O3", "-march=native", "-fopenmp", *_vector_flags()],
                                  extra_ldflags=["-fopenmp"])
    except Exception as exc:   # a missing toolchain piece shows up only here
        log.warning("%s: build failed (%s); using %s", label, str(exc).splitlines()[0], fallback)
        return None


class Kernel:
    """A kernel module built on first use and at most once a process: `load()` returns it, or None (see `load`)."""

    def __init__(self, name: str, sources: list[Path], label: str, fallback: str):
        self.name, self.sources, self.label, self.fallback = name, sources, label, fallback
        self.module = None
        self._tried = False

    def load(self):
        if not self._tried:
            self._tried = True
            self.module = load(self.name, self.sources, self.label, self.fallback)
        return self.module
