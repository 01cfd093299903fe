"""Rank 0's model runner under tensor parallelism: it starts the worker ranks (torch.multiprocessing, spawn), holds
rank 0's slice of the model, and mirrors every call that touches the model or the KV pools on the workers before
running it itself: the forward (then the logits gather), KV pool allocation, block copies.

A worker that dies or hangs stops the step: the collective it leaves fails at once (its sockets close) or after
group.TIMEOUT_S, and the runner then ends the other workers, tears the process group down and raises
TensorParallelError naming the rank; every later call raises it again.
"""
from __future__ import annotations

import logging
import pickle
import signal
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from batchrun.config import EngineConfig
from batchrun.engine.model_build import build_model
from batchrun.engine.model_runner import ModelRunner, StepInputs
from batchrun.engine.parallel import TensorParallelError, group, shard, worker

log = logging.getLogger("batchrun")
READY_TIMEOUT_S = 600   # loading a rank's slice of a large checkpoint


@dataclass
class Worker:
    rank: int
    process: mp.Process
    conn: Connection

    def describe(self) -> str:
        code = self.process.exitcode
        if code is None:
            return f"rank {self.rank} (pid {self.process.pid}) did not answer"
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return f"rank {self.rank} (pid {self.process.pid}) died ({how})"


class TensorParallelRunner(ModelRunner):
    def __init__(self, config: EngineConfig, model_path: str, hf_config, device: torch.device, dtype: torch.dtype,
                 max_model_len: int):
        size = config.tensor_parallel_size
        shard.check(hf_config, size)   # before any process starts
        if dist.is_initialized():
            raise ValueError("tensor_parallel_size: this process already runs a tensor-parallel engine; close it "
                             "first (LLM.close())")
        self.error: str | None = None
        port, ctx = group.free_port(), mp.get_context("spawn")
        self.workers: list[Worker] = []
        for rank in range(1, size):
            parent, child = ctx.Pipe()
            process = ctx.Process(target=worker.main, name=f"batchrun-tp-rank{rank}", daemon=True,
                                  args=(rank, port, config, model_path, device, dtype, max_model_len, child))
            process.start()
            child.close()
            self.workers.append(Worker(rank, process, parent))
        self._closer = weakref.finalize(self, _shutdown, self.workers)
        if device.type == "cpu":
            torch.set_num_threads(worker.cpu_threads(size))
            log.info("tensor parallel: %d ranks on the CPU, %d threads each", size, torch.get_num_threads())
        try:
            group.init(0, size, port, device)
            model, _ = build_model(config, model_path, hf_config, device, dtype, max_model_len, shard.Shard(0, size))
            self._wait_ready()
        except BaseException:
            self.close()
            raise
        super().__init__(model, config.block_size, device)

    def _wait_ready(self) -> None:
        for w in self.workers:
            if not w.conn.poll(READY_TIMEOUT_S):
                raise TensorParallelError(f"tensor parallel: {w.describe()} while loading its slice of the model")
            try:
                status, detail = w.conn.recv()
            except EOFError:
                w.process.join(5)
                raise TensorParallelError(f"tensor parallel: {w.describe()} while loading its slice of the model")
            if status == "error":
                raise ValueError(f"tensor parallel: rank {w.rank} failed to load the model:\n{detail}")

    def close(self) -> None:
        """Stop the workers and leave the process group (also done when the runner is garbage-collected)."""
        self._closer()

    # --- the calls mirrored on every rank ---
    def allocate_kv(self, pools: list[tuple[int, torch.dtype]]) -> None:
        self._on_all_ranks("allocate_kv", pools)

    def copy_blocks(self, pool: int, pairs: list[tuple[int, int]]) -> None:
        self._on_all_ranks("copy_blocks", pool, pairs)

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        return self._on_all_ranks("execute", inputs)

    def _on_all_ranks(self, command: str, *args):
        if self.error is not None:
            raise TensorParallelError(self.error)
        try:
            message = pickle.dumps((command, args))
            for w in self.workers:
                w.conn.send_bytes(message)
            result = getattr(super(), command)(*args)
            if command == "execute":
                result = group.gather_columns(result, len(self.workers) + 1)
            return result
        except Exception as exc:   # noqa: BLE001 -- a collective or a pipe failed: find the rank and stop them all
            self._fail(command, exc)

    def _fail(self, command: str, exc: Exception) -> None:
        for w in self.workers:
            w.process.join(1)   # a rank that just died: let its exit code arrive
        dead = [w.describe() for w in self.workers if not w.process.is_alive()]
        what = ", ".join(dead) or (f"no rank exited; the step failed on rank 0 or in a collective (timeout "
                                   f"{group.TIMEOUT_S:g} s)")
        self.error = (f"tensor parallel: {what}; the {command} step stopped "
                      f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
        log.error("%s", self.error)
        for w in self.workers:   # a rank stuck in a collective would not read "stop"
            w.process.kill()
        self.close()
        raise TensorParallelError(self.error) from exc


def _shutdown(workers: list[Worker]) -> None:
    """Ask each live worker to stop, kill those that do not within seconds, then leave the process group."""
    for w in workers:
        try:
            w.conn.send_bytes(pickle.dumps(("stop", ())))
        except OSError:
            pass
    for w in workers:
        w.process.join(5)
        if w.process.is_alive():
            w.process.kill()
            w.process.join(5)
        w.conn.close()
    group.destroy()
