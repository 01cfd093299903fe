"""Releasing a thread's OpenMP worker threads before another thread takes over the engine's steps.

libgomp keeps a pool of worker threads for each thread that has started a parallel region. The thread that builds
the engine (its weights, its warm-up) owns one; a background thread that then steps the engine builds a second. With
more pooled threads than cores libgomp throttles how long an idle worker spins before it sleeps (its GOMP_SPINCOUNT
rule; inferred, not profiled: with GOMP_SPINCOUNT=0 a 0.5 ms AMX product on 2 threads took as long from the main
thread as from a second one), and the few thousand parallel regions of a step then wake sleeping workers.
`python bench/serve_vs_vllm.py`'s load run in process (64 random 256-token prompts, 64 tokens each, SmolLM2 bf16, 2
threads of an Intel Xeon): offline generate 386-399 output tok/s from the main thread, 290-300 from a second thread,
383-405 from a second thread once the first thread's pool was released. omp_pause_resource_all (OpenMP 5.0) frees
the calling thread's pool; the next parallel region there builds a new one.
"""
from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger("batchrun")

OMP_PAUSE_HARD = 2   # omp_pause_resource_t: free the threads, not only let them sleep


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process loaded (torch's, on Linux), where it has omp_pause_resource_all."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and line.rstrip().endswith(".so.1")}
    except OSError:
        return None
    for path in sorted(paths):
        library = ctypes.CDLL(path)
        if hasattr(library, "omp_pause_resource_all"):
            return library
    return None


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker threads (call it outside any parallel region); False where this
    process's OpenMP runtime is not libgomp or cannot."""
    library = _libgomp()
    if library is None:
        return False
    released = library.omp_pause_resource_all(OMP_PAUSE_HARD) == 0
    if not released:
        log.debug("libgomp kept this thread's OpenMP pool")
    return released
