"""What one engine step did: its shape (what the cost models price) and where its time went. The engine hands
each step's StepStats to its observers (Engine.observe): the job's ETA, calibration, gpucheck and the benchmarks
watch steps this way instead of wrapping the engine's methods."""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class StepShape:
    tokens: int = 0        # tokens computed this step (prefill chunks + one per decoding sequence)
    seqs: int = 0          # sequences scheduled
    kv_tokens: int = 0     # sum over scheduled sequences of their context after the step (KV read)
    attn_pairs: int = 0    # sum over scheduled tokens of the positions each attends to (attention FLOPs / 4 L H d)
    kv_bytes: int = 0      # KV bytes read, where lanes store KV in different dtypes (0: kv_tokens x the model's)
    shared_kv_tokens: int = 0   # of kv_tokens, those in blocks an earlier sequence of the step also reads

    @property
    def unique_kv_tokens(self) -> int:
        return self.kv_tokens - self.shared_kv_tokens

    @property
    def prefill_pairs(self) -> int:
        """Attention pairs beyond one read of each sequence's context: what a prefill chunk's new tokens x its
        context add over a decode step (0 for a step of decodes alone)."""
        return max(self.attn_pairs - self.kv_tokens, 0)

    @classmethod
    def of(cls, scheduled, block_size: int = 0) -> "StepShape":
        """The shape of a planned step [(request, tokens)], read before the requests advance. With the pool's
        block_size, the context in blocks that an earlier sequence of the step also reads (a prefix cached once, a
        fork's parent's) is counted apart: memory serves such a block once, and it cost 0.52-0.75 of a private one
        in decode steps on the CPU (linear_fit.SHARED_RATIO)."""
        tokens = kv = pairs = 0
        tables: dict[str, list[list[int]]] = defaultdict(list)   # each lane's pool numbers its own blocks
        for request, n in scheduled:
            done = request.num_computed_tokens
            tokens += n
            kv += done + n
            pairs += n * done + n * (n + 1) // 2
            if block_size:
                tables[request.lane].append(request.block_table)
        # blocks are shared full (a cache hit, a fork's copy-on-write keeps the partial one private): each table
        # holding a block after the first adds a block of shared tokens
        shared = block_size * sum(sum(map(len, lane)) - len(set().union(*lane)) for lane in tables.values())
        return cls(tokens, len(scheduled), kv, pairs, shared_kv_tokens=shared)


@dataclass
class StepStats:
    step: int = 0
    shape: StepShape = field(default_factory=StepShape)
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    prefix_cache_hit_tokens: int = 0   # cumulative
    preemptions: int = 0               # cumulative
    prompt_tokens: int = 0             # cumulative, processed (recompute included)
    output_tokens: int = 0             # cumulative
    step_time: float = 0.0             # the whole step, seconds
    # Its phases, seconds. On CUDA the forward is asynchronous: an observer that asks for synchronised phases makes
    # the engine wait for the device at each boundary; otherwise the sampler's time includes the forward's tail.
    schedule_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0              # grammar masks, sampling, forks
    update_s: float = 0.0              # the scheduler's update, detokenizing finished requests


class PhaseClock:
    """Seconds per phase of one step; `synchronize` (waiting for the device) runs at each lap when given."""

    def __init__(self, synchronize: Callable[[], None] | None = None):
        self.sync = synchronize
        self.start = self.last = time.perf_counter()
        self.laps = dict.fromkeys(("schedule_s", "forward_s", "sample_s", "update_s"), 0.0)

    def lap(self, phase: str) -> None:
        if self.sync is not None:
            self.sync()
        now = time.perf_counter()
        self.laps[phase] += now - self.last
        self.last = now

    @property
    def total(self) -> float:
        return self.last - self.start
