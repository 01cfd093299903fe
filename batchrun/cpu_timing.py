"""Short timed probes on the CPU (the bf16 dtype probe, the oneDNN int8 probe), on one thread. On a busy machine two
threads wait for each other's time slices: with four busy processes on two cores both int8 products took 12 ms a run
for 100 ms at a stretch, and a probe on two threads judged oneDNN's fast path slow in 17 of 200 tries."""
from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch


@contextlib.contextmanager
def one_thread():
    """torch on one thread inside the block; the caller's thread count back after it, whatever happens."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def seconds(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start
