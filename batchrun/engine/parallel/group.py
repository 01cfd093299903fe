"""The tensor-parallel process group: set-up with a timeout on every collective, teardown, and the two
collectives the forward needs (an all-reduce, usable inside the whole-model graph, and the gather of logits)."""
from __future__ import annotations

import datetime
import os
import socket
import time

import torch
import torch.distributed as dist

# A collective that waits longer than this fails (a rank that died or hangs) instead of blocking its peers. The
# first steps of each rank compile their graphs, which can take a minute on a busy CPU.
TIMEOUT_S = float(os.environ.get("BATCHRUN_TP_TIMEOUT_S", "300"))
JOIN_TIMEOUT_S = 300


class Comm:
    """Seconds spent in collectives, per rank (bench/tp.py reads rank 0's)."""
    seconds = 0.0
    calls = 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(rank: int, world_size: int, port: int, device: torch.device) -> None:
    """Join the group of `world_size` ranks that rank 0 listens for on 127.0.0.1:`port` (each rank may take
    JOIN_TIMEOUT_S to start: a fresh interpreter importing torch)."""
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=TIMEOUT_S))


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _timed_all_reduce(x: torch.Tensor) -> None:
    start = time.perf_counter()
    dist.all_reduce(x)
    Comm.seconds += time.perf_counter() - start
    Comm.calls += 1


@torch.library.custom_op("batchrun::tp_all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    _timed_all_reduce(out)
    return out


@_all_reduce_op.register_fake
def _(x):
    return torch.empty_like(x)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the ranks. Inside the whole-model graph an opaque op (the graph runs on, collectives are
    not traced); eagerly in place."""
    if torch.compiler.is_compiling():
        return torch.ops.batchrun.tp_all_reduce(x)
    _timed_all_reduce(x)
    return x


def gather_columns(local: torch.Tensor, world_size: int) -> torch.Tensor | None:
    """Every rank's [rows, cols] joined along the columns on rank 0 (None on the others)."""
    start = time.perf_counter()
    if dist.get_rank() == 0:
        parts = [torch.empty_like(local) for _ in range(world_size)]
        dist.gather(local.contiguous(), parts, dst=0)
        out = torch.cat(parts, dim=-1)
    else:
        dist.gather(local.contiguous(), None, dst=0)
        out = None
    Comm.seconds += time.perf_counter() - start
    Comm.calls += 1
    return out
