"""A tensor-parallel worker rank (ranks 1..N-1): a process that holds its slice of the model and its KV pools, and
runs what rank 0 sends down its pipe: each step's forward inputs (then its part of the logits gather), KV pool
(re)allocation and block copies. It never schedules: its block tables are rank 0's.

The pipe carries pickles between these two processes of one batchrun run only (nothing a user supplies). When rank
0 exits the pipe closes and the worker ends; when a collective fails (a rank died) or times out, the error ends it.
"""
from __future__ import annotations

import os
import pickle
import traceback
from multiprocessing.connection import Connection

import torch

from batchrun.config import EngineConfig
from batchrun.engine import loader
from batchrun.engine.model_build import build_model
from batchrun.engine.model_runner import ModelRunner
from batchrun.engine.parallel import group
from batchrun.engine.parallel.shard import Shard


def cpu_threads(size: int) -> int:
    """Threads per rank on the CPU: the cores this process may use, shared evenly among the ranks."""
    return max(1, len(os.sched_getaffinity(0)) // size)


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


def main(rank: int, port: int, config: EngineConfig, model_path: str, device: torch.device, dtype: torch.dtype,
         max_model_len: int, conn: Connection) -> None:
    size = config.tensor_parallel_size
    device = rank_device(device, rank)
    try:
        if device.type == "cpu":
            torch.set_num_threads(cpu_threads(size))
        else:
            torch.cuda.set_device(device)
        group.init(rank, size, port, device)
        hf_config = loader.load_config(model_path, config.trust_remote_code)
        model, _ = build_model(config, model_path, hf_config, device, dtype, max_model_len, Shard(rank, size))
        runner = ModelRunner(model, config.block_size, device)
    except Exception:   # noqa: BLE001 -- rank 0 reports it, with this rank's traceback
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    try:
        while True:
            try:
                command, args = pickle.loads(conn.recv_bytes())
            except EOFError:   # rank 0 is gone
                break
            if command == "stop":
                break
            if command == "execute":
                group.gather_columns(runner.execute(*args), size)
            else:
                getattr(runner, command)(*args)
    finally:
        group.destroy()
