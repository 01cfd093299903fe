"""Continuous batching: each step, every request catches up toward its token count within a token budget.

Prefill, chunked prefill, decode and recompute after preemption all follow from one rule: a scheduled
request computes `min(num_tokens - num_computed_tokens, budget left)` tokens this step.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable

from batchrun.engine.block_manager import BlockManager
from batchrun.engine.request import Request, RequestStatus


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


@dataclass
class StepPlan:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # request, tokens to compute
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 admission_key: Callable[[Request], tuple] = default_admission_key):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting = WaitingQueue(admission_key)
        self.running: list[Request] = []   # admission order: the last one is preempted first
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.push(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.block_manager.allocate_slots(request, n):
                victim = self.running.pop()
                self._preempt(victim, plan)
                if victim is request:
                    break
            else:
                plan.scheduled.append((request, n))
                budget -= n
                i += 1
        if plan.preempted:   # the pool is full: admitting more would only preempt again
            return plan
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            hits = self.block_manager.get_computed_blocks(request)
            cached = len(hits) * self.block_manager.block_size
            n = min(request.num_tokens - request.num_computed_tokens - cached, budget)
            if not self.block_manager.allocate_slots(request, n, hits):
                break
            self.waiting.pop()
            request.num_computed_tokens += cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.scheduled.append((request, n))
            budget -= n
        return plan

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Free the request's blocks; it recomputes (often from the prefix cache) when readmitted."""
        self.block_manager.free_request(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.num_preemptions += 1
        plan.preempted.append(request)
        self.waiting.push(request)

    def finish(self, request: Request) -> None:
        """Release a finished request, running or waiting."""
        if request in self.running:
            self.running.remove(request)
            self.block_manager.free_request(request)
        else:
            self.waiting.remove(request)
