"""The CPU decode-attention kernel (cpu_attention.cpp), built once per machine with the system C++ compiler.

Decode attention on a CPU is bound by reading K/V. The pure-torch path gathers each request's blocks into a
contiguous copy and then reads them again with small batched products; the kernel reads the pool where it lies,
once, dequantizing 8-bit codes in the loop (one layer, 32 requests x 400 tokens, AMD EPYC 2 cores: 9.8 ms -> 1.8 ms
float32, 1.3 ms int8; tests/test_cpu_attention.py checks it against the reference). The build is
cached under BATCHRUN_CACHE, keyed by the source, torch's version and this CPU's flags (it is compiled with
-march=native). Where no compiler is found or the build fails, `load()` returns None and the engine keeps the
torch path, saying why in the log. BATCHRUN_CPU_KERNELS=0 turns the kernel off.
"""
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
_SOURCE = Path(__file__).with_name("cpu_attention.cpp")
_module = None
_tried = False


def _build_dir() -> Path:
    source = _SOURCE.read_bytes()
    flags = " ".join(sorted(cpu_flags()))
    key = hashlib.sha256(source + torch.__version__.encode() + flags.encode()).hexdigest()[:16]
    return cache_dir() / "cpu_kernels" / key


def load():
    """The compiled module, or None (no compiler, failed build, or turned off); built at most once a process."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get("BATCHRUN_CPU_KERNELS", "1") == "0":
        log.info("CPU attention kernel: off (BATCHRUN_CPU_KERNELS=0); using the torch path")
        return None
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        log.warning("CPU attention kernel: no C++ compiler found; using the slower torch path")
        return None
    from torch.utils import cpp_extension
    build = _build_dir()
    build.mkdir(parents=True, exist_ok=True)
    if not any(build.glob("*.so")):
        log.info("CPU attention kernel: building once into %s (about a minute)", build)
    # Build from a copy in the (content-keyed) build directory: ninja records the source's path, so building from
    # the checkout made every other checkout of the same source (a worktree, a Ray worker's copy) rebuild.
    source = build / _SOURCE.name
    if not source.exists():
        shutil.copyfile(_SOURCE, source)
    try:
        _module = cpp_extension.load(name="batchrun_cpu_attention", sources=[str(source)], build_directory=str(build),
                                     extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                                     extra_ldflags=["-fopenmp"])
    except Exception as exc:   # a missing toolchain piece shows up only here
        log.warning("CPU attention kernel: build failed (%s); using the slower torch path", str(exc).splitlines()[0])
        _module = None
    return _module


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Same contract as reference.paged_decode_attention; call only when load() returned a module."""
    out = _module.paged_decode_attention(query.float().contiguous(), k_cache, v_cache, k_scale, v_scale,
                                         block_tables.long().contiguous(), context_lens.long().contiguous(), scale,
                                         window or 0, softcap or 0.0)
    return out.to(query.dtype)
