"""Continuous batching: each step, every request catches up toward its token count within a token budget.

Prefill, chunked prefill, decode and recompute after preemption all follow from one rule: a scheduled
request computes `min(num_tokens - num_computed_tokens, budget left)` tokens this step.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Iterable

from batchrun.engine.block_manager import BlockManager
from batchrun.engine.request import Request, RequestStatus
from batchrun.engine.stop import StopRule


def default_admission_key(request: Request) -> tuple:
    """Higher priority first, then the caller's order key (e.g. a length bucket), then arrival."""
    return (-request.priority, request.order_key, request.arrival_index)


class WaitingQueue:
    """Requests not running, popped in admission order. Preempted requests keep their key."""

    def __init__(self, key: Callable[[Request], tuple] = default_admission_key):
        self.key = key
        self._heap: list[tuple[tuple, int, Request]] = []

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (self.key(request), request.arrival_index, request))

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> bool:
        for i, entry in enumerate(self._heap):
            if entry[2] is request:
                self._heap.pop(i)
                heapq.heapify(self._heap)
                return True
        return False

    def __len__(self) -> int:
        return len(self._heap)

    def ordered(self) -> list[Request]:
        """The waiting requests in the order they would be admitted."""
        return [entry[2] for entry in sorted(self._heap, key=lambda entry: entry[:2])]


@dataclass
class StepPlan:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # request, tokens to compute
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    # Both read the requests as planned, before Scheduler.update advances them.
    @property
    def num_prompt_tokens(self) -> int:
        """Scheduled tokens that are prompt (recompute after preemption included)."""
        return sum(max(0, min(n, r.num_prompt_tokens - r.num_computed_tokens)) for r, n in self.scheduled)

    @property
    def sampling(self) -> list[Request]:
        """The requests whose scheduled tokens reach their last token: each samples one token this step."""
        return [r for r, n in self.scheduled if r.num_computed_tokens + n == r.num_tokens]


@dataclass(eq=False)
class Lane:
    """A class of requests with its own KV pool (block manager), queue and caps.

    Lanes are scheduled in priority order; a lower lane always keeps what the caps above it leave
    (the batch lane's guaranteed share of the token budget).
    """
    name: str
    block_manager: BlockManager
    max_num_seqs: int
    token_cap: int
    waiting: WaitingQueue
    running: list[Request] = field(default_factory=list)   # admission order: the last is preempted first
    yield_cap: int | None = None   # the token cap in steps where a higher lane has requests (None: token_cap)


class Scheduler:
    def __init__(self, lanes: list[Lane], max_num_seqs: int, max_num_batched_tokens: int,
                 stop_rule: StopRule = StopRule(), max_adapters: int | None = None):
        self.lanes = lanes                       # highest priority first
        self.max_adapters = max_adapters         # distinct LoRA adapters among running requests; None: any
        self._lane_by_name = {lane.name: lane for lane in lanes}
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.stop_rule = stop_rule
        self.num_preemptions = 0
        self.decode_steps_asked = 0   # steps still to run with the decodes alone (run_decodes_alone)

    @classmethod
    def single_lane(cls, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                    admission_key: Callable[[Request], tuple] = default_admission_key) -> "Scheduler":
        """One pool for every request (no interactive lane), as simulations and tools use it."""
        lane = Lane("batch", block_manager, max_num_seqs, max_num_batched_tokens, WaitingQueue(admission_key))
        return cls([lane], max_num_seqs, max_num_batched_tokens)

    def lane_of(self, request: Request) -> Lane:
        return self._lane_by_name[request.lane]

    @property
    def running(self) -> list[Request]:
        return [r for lane in self.lanes for r in lane.running]

    @property
    def waiting(self) -> list[Request]:
        return [r for lane in self.lanes for r in lane.waiting.ordered()]

    @property
    def num_waiting(self) -> int:
        return sum(len(lane.waiting) for lane in self.lanes)

    def add(self, request: Request) -> None:
        if request.lane not in self._lane_by_name:
            raise ValueError(f"lane: unknown lane {request.lane!r}; lanes: {', '.join(self._lane_by_name)}")
        self.lane_of(request).waiting.push(request)

    def has_unfinished(self) -> bool:
        return any(lane.waiting or lane.running for lane in self.lanes)

    def run_decodes_alone(self, steps: int) -> None:
        """Run the next `steps` steps that have decoding requests with those alone: no prefill chunk beside them and
        no admission. A job's ETA asks for a few when its first steps were all prefill chunks: a chunk's step is the
        chunk's compute, a decode step's is reading the weights, and the first tells nothing of the second (fits on
        the chunks of the sample's first 8-10 s at bf16 priced its decode steps 0.26-3.96x). The cost is small: the
        sample's 4 such steps took 45-65 ms each (SmolLM2, bf16, two cores), where the same 26-28 decodes beside a
        1,024-token chunk take about 20 ms of its time. Only the batch lane (the last) is held so: a lane above it
        (interactive requests) admits and prefills as ever."""
        self.decode_steps_asked = max(self.decode_steps_asked, steps)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        batch = self.lanes[-1]
        decodes_alone = self.decode_steps_asked > 0 and any(_decoding(r) for r in batch.running)
        if decodes_alone:
            self.decode_steps_asked -= 1
        budget, busy_above = self.max_num_batched_tokens, False
        for lane in self.lanes:
            cap = lane.token_cap if not busy_above or lane.yield_cap is None else min(lane.token_cap, lane.yield_cap)
            lane_budget = min(budget, cap)
            alone = decodes_alone and lane is batch
            used = self._schedule_running(lane, lane_budget, plan, alone)
            if not plan.preempted and not alone:   # a full pool would only preempt again
                used += self._admit(lane, lane_budget - used, plan)
            budget -= used
            busy_above = busy_above or bool(lane.running or lane.waiting)
        return plan

    def _schedule_running(self, lane: Lane, budget: int, plan: StepPlan, decodes_alone: bool = False) -> int:
        used, i = 0, 0
        while i < len(lane.running) and used < budget:
            request = lane.running[i]
            if decodes_alone and not _decoding(request):
                i += 1
                continue
            n = min(request.num_tokens - request.num_computed_tokens, budget - used)
            while not lane.block_manager.allocate_slots(request, n):
                victim = lane.running.pop()
                self._preempt(victim, lane, plan)
                if victim is request:
                    break
            else:
                self._plan(request, n, lane, plan)
                used += n
                i += 1
        return used

    def _admit(self, lane: Lane, budget: int, plan: StepPlan) -> int:
        used, deferred = 0, []
        while lane.waiting and used < budget and len(lane.running) < lane.max_num_seqs:
            if sum(len(x.running) for x in self.lanes) >= self.max_num_seqs and not self._free_a_seat(lane, plan):
                break
            request = lane.waiting.peek()
            if not self._adapter_fits(request):   # waits for a running adapter's rows to finish; others go ahead
                deferred.append(lane.waiting.pop())
                continue
            if request.forks_pending and lane.running and len(lane.running) + request.params.n > lane.max_num_seqs:
                break   # its samples will take n seats
            hits = lane.block_manager.get_computed_blocks(request)
            cached = len(hits) * lane.block_manager.block_size
            n = min(request.num_tokens - request.num_computed_tokens - cached, budget - used)
            if not lane.block_manager.allocate_slots(request, n, hits):
                break
            lane.waiting.pop()
            request.num_computed_tokens += cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = cached
            request.status = RequestStatus.RUNNING
            lane.running.append(request)
            self._plan(request, n, lane, plan)
            used += n
        for request in deferred:
            lane.waiting.push(request)
        return used

    @staticmethod
    def _plan(request: Request, n: int, lane: Lane, plan: StepPlan) -> None:
        """Schedule n tokens of the request this step; the blocks they fill enter the prefix cache now, so a request
        admitted after it in this step reads them (BlockManager.cache_full_blocks; unplan if the forward fails)."""
        plan.scheduled.append((request, n))
        lane.block_manager.cache_full_blocks(request, request.num_computed_tokens + n)

    def _adapter_fits(self, request: Request) -> bool:
        """Its adapter is among the running requests' or one more stays within max_adapters (base always fits)."""
        if request.adapter is None or self.max_adapters is None:
            return True
        running = {r.adapter for r in self.running} - {None}
        return request.adapter in running or len(running) < self.max_adapters

    def _free_a_seat(self, lane: Lane, plan: StepPlan) -> bool:
        """All seats taken: a higher lane takes one from the lowest lane below it, never the reverse."""
        below = self.lanes[self.lanes.index(lane) + 1:]
        for lower in reversed(below):
            unscheduled = [r for r in lower.running if all(r is not s for s, _ in plan.scheduled)]
            if unscheduled:
                lower.running.remove(unscheduled[-1])
                self._preempt(unscheduled[-1], lower, plan)
                return True
        return False

    def _preempt(self, request: Request, lane: Lane, plan: StepPlan) -> None:
        """Free the request's blocks; it recomputes (often from the prefix cache) when readmitted."""
        self._requeue(request, lane)
        request.num_preemptions += 1
        self.num_preemptions += 1
        plan.preempted.append(request)

    @staticmethod
    def _requeue(request: Request, lane: Lane) -> None:
        lane.block_manager.free_request(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        lane.waiting.push(request)

    def unplan(self, plan: StepPlan) -> None:
        """The step's forward failed: the blocks registered for the tokens it was to compute leave the prefix cache,
        and a request admitted on some of them (a prefix another request was computing in the step) waits and
        recomputes. The others stand as before the step: their computed tokens were not advanced."""
        unwritten = set()
        for request, _ in plan.scheduled:
            unwritten |= self.lane_of(request).block_manager.uncache_unwritten(request)
        for request, _ in plan.scheduled:
            lane = self.lane_of(request)
            full = request.num_computed_tokens // lane.block_manager.block_size
            if request in lane.running and unwritten.intersection(request.block_table[:full]):
                lane.running.remove(request)
                self._requeue(request, lane)
                request.block_hashes.clear()

    def update(self, plan: StepPlan, sampled: Iterable[tuple[Request, int, float | None]]) -> list[Request]:
        """After the forward: advance each scheduled request by its tokens (their full blocks entered the prefix
        cache when the step was planned), append each sampled (request, token, logprob), and finish and free the
        requests the stop rule ends. Returns those."""
        for request, n in plan.scheduled:
            request.num_computed_tokens += n
        finished = []
        for request, token, logprob in sampled:
            request.token_ids.append(token)
            if logprob is not None:
                request.logprobs.append(logprob)
            try:
                reason = self.stop_rule(request)
            except Exception as exc:   # noqa: BLE001 -- one request's stop rule must not end the step for others
                request.error, reason = f"stop rule failed: {type(exc).__name__}: {exc}", "error"
            if reason:
                self.finish(request, reason)
                finished.append(request)
        return finished

    def fork(self, parent: Request, siblings: list[Request], share: bool = True) -> list[tuple[int, int]]:
        """Samples 1..n-1 of a prompt sampled for the first time this step: each shares the parent's prompt KV and
        runs from the next step (one that finds no block for its copy, or all when not `share`, waits and
        recomputes when admitted). Returns the (source, destination) blocks to copy in the lane's KV pool."""
        lane, copies = self.lane_of(parent), []
        for sibling in siblings:
            pairs = lane.block_manager.fork(parent, sibling, parent.num_tokens) if share else None
            if pairs is None:
                lane.waiting.push(sibling)
                continue
            copies += pairs
            sibling.num_computed_tokens = sibling.num_cached_tokens = parent.num_tokens
            sibling.status = RequestStatus.RUNNING
            lane.running.append(sibling)
        return copies

    def finish(self, request: Request, reason: str) -> None:
        """Release a request, running or waiting, and mark it finished (a finished request is left as it is)."""
        if request.finished:
            return
        lane = self.lane_of(request)
        if request in lane.running:
            lane.running.remove(request)
            lane.block_manager.free_request(request)
        else:
            lane.waiting.remove(request)
        request.status, request.finish_reason = RequestStatus.FINISHED, reason


def _decoding(request: Request) -> bool:
    """Whether the request's next step computes one token (its prompt and outputs so far are in its KV)."""
    return request.num_tokens - request.num_computed_tokens == 1
