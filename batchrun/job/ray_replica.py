"""One engine replica on Ray: an actor that loads the model once and turns batches of input rows into committed
shards.

Ray Data calls the actor with several batches at once (max_concurrency): each call queues its rows in the one
engine, and a single stepping task drives the engine while any call waits, so the continuous batch keeps running
across batch edges. A call returns after its shard is committed, with one row of figures for the driver's progress
(rows, tokens, this replica's engine figures), never the results themselves.

Exactly once: the shard's name is a function of the run and of the row indices it holds, so when Ray retries a
batch (its actor died after writing) the retry rewrites the same shard instead of adding a second copy. A shard is
committed only while the run's token in OUT/.ray_run is this run's: actors left over from a killed driver cannot
add rows that a resumed run has already planned to do again.
"""
from __future__ import annotations

import asyncio
import os
import resource
import socket
import time

import pyarrow as pa

from batchrun.job.prompts import PromptEncoder
from batchrun.job.records import RecordMaker
from batchrun.job.object_shards import shard_name
from batchrun.job.sink import ShardStore, shard_store, write_shard
from batchrun.job.source import records, row_from_record
from batchrun.job.spec import JobSpec
from batchrun.job.storage import Storage, as_storage

RUN_TOKEN = ".ray_run"


def read_token(out_dir: Storage | str) -> str | None:
    text = as_storage(out_dir).read_text(RUN_TOKEN)
    return None if text is None else text.strip()


class StaleRun(RuntimeError):
    """This actor's run was replaced (its driver died and the job was submitted again): do not commit."""


class ReplicaEngine:
    def __init__(self, spec: JobSpec, engine_options: dict, out_dir: Storage, schema: pa.Schema, run_number: int,
                 run_token: str, threads: int):
        import torch

        from batchrun import LLM
        torch.set_num_threads(threads)
        started = time.perf_counter()
        self.spec, self.out_dir, self.schema = spec, out_dir, schema
        self.run_number, self.run_token = run_number, run_token
        self.store = shard_store(out_dir)
        self.llm = LLM(model=spec.model, **engine_options)
        self.engine = self.llm.engine
        self.encoder = PromptEncoder(spec.input, self.llm.tokenizer, self.engine.max_model_len)
        self.replica = f"{socket.gethostname()}:{os.getpid()}"
        self.load_s = time.perf_counter() - started
        self.ready_at = time.time()
        self.record_maker = RecordMaker(spec)
        self.waiting: dict[str, asyncio.Future] = {}   # request id -> its samples' final outputs, once all are in
        self.stepper: asyncio.Task | None = None
        self.batches = 0
        self.kv_peak = 0

    async def __call__(self, batch: pa.Table) -> pa.Table:
        started = time.perf_counter()
        indices = batch.column("row_index").to_pylist()
        rows = [row_from_record(self.spec, index, r) for index, r in zip(indices, records(batch))]
        self.encoder.prepare(rows)
        good = [row for row in rows if not row.error]
        if self.spec.batching.bucketing:   # length bucketing inside each batch, shortest (or longest) first
            good.sort(key=lambda r: len(r.token_ids), reverse=self.spec.batching.longest_first)
        self.batches += 1
        loop = asyncio.get_running_loop()
        futures = []
        for rank, row in enumerate(good):
            future = loop.create_future()
            self.waiting[str(row.index)] = future
            futures.append(future)
            self.llm.add_request(row.token_ids, row.params, request_id=str(row.index),
                                 lane=self.spec.engine.lane, order_key=(self.batches, rank))
        if self.stepper is None or self.stepper.done():
            self.stepper = asyncio.create_task(self._step())
        outs = dict(zip((row.index for row in good), await asyncio.gather(*futures)))
        results = [record for row in rows for record in self.record_maker.records(row, outs.get(row.index))]
        self._commit(indices, results)
        tokens = sum(r["completion_tokens"] for r in results)
        failed = len({r["row_index"] for r in results if r["status"] == "error"})   # input rows, not samples
        return pa.table(self._figures(len(rows), failed, tokens,
                                      time.perf_counter() - started))

    async def _step(self) -> None:
        """Step the engine while any call waits; yield between steps so new batches join the running batch."""
        try:
            while self.waiting:
                for out in self.llm.step():
                    if out.prompt_outputs is not None:   # the row's last sample finished
                        self.waiting.pop(out.request_id).set_result(out.prompt_outputs)
                self.kv_peak = max(self.kv_peak, self.engine.stats.kv_blocks_used)
                await asyncio.sleep(0)
        except Exception as exc:   # an engine failure fails the waiting calls instead of leaving them hanging
            for future in self.waiting.values():
                future.set_exception(exc)
            self.waiting.clear()

    def _commit(self, indices: list[int], results: list[dict]) -> None:
        if read_token(self.out_dir) != self.run_token:
            raise StaleRun(f"{self.out_dir}: the job was submitted again; this replica's run no longer commits")
        table = pa.Table.from_pylist(results, schema=self.schema)
        if isinstance(self.store, ShardStore):
            write_shard(self.store.dir, shard_name(self.run_number, indices), table)
        else:   # an object store: the shard in one PUT, then its manifest entry
            self.store.commit(shard_name(self.run_number, indices), table)

    def _figures(self, rows: int, failed: int, tokens: int, batch_s: float) -> dict:
        engine = self.engine
        return {"replica": [self.replica], "rows": [rows], "failed": [failed], "output_tokens": [tokens],
                "batch_s": [batch_s], "finished_at": [time.time()], "ready_at": [self.ready_at],
                "load_s": [self.load_s],
                "preemptions": [engine.stats.preemptions], "kv_cache_dtype": [engine.config.kv_cache_dtype],
                "kv_blocks_peak": [self.kv_peak], "kv_blocks_total": [engine.num_blocks],
                "kv_pool_bytes": [engine.num_blocks * engine.config.block_size * engine.kv_bytes_per_token],
                "peak_rss_bytes": [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]}
