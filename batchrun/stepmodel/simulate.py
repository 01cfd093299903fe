"""Discrete-event simulation: the engine's real Scheduler and BlockManager, a cost model instead of a forward.

Each simulated step is what Engine.step() does minus the model: schedule, then the scheduler's own step update with
token 0 for each request that caught up (it finishes once it has its output length). The step's shape (tokens,
sequences, KV read) is recorded; a step-time model turns the trace into a timeline, so one trace serves every GPU
type with the same pool size.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from batchrun.admission_order import window_order
from batchrun.engine.block_manager import BlockManager
from batchrun.engine.request import Request, RequestStatus
from batchrun.engine.scheduler import Scheduler, StepPlan
from batchrun.engine.step_stats import StepShape
from batchrun.sampling_params import SamplingParams


@dataclass(frozen=True)
class WorkItem:
    """One request of the job: its prompt (token ids, or only a length) and how many tokens it will generate.
    `computed` > 0: a request already running, whose first `computed` tokens are in the KV cache (a job's ETA
    simulates from the engine's present state); `generated` of them are its output so far, in blocks of its own
    (what it shares through the prefix cache is its prompt's)."""
    prompt: tuple[int, ...] | int
    output_tokens: int
    computed: int = 0
    generated: int = 0   # of the prompt's tokens, the last are this many tokens the running request generated

    @property
    def prompt_len(self) -> int:
        return self.prompt if isinstance(self.prompt, int) else len(self.prompt)


@dataclass
class Trace:
    shapes: list[StepShape] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)      # requests finished at each step
    out_tokens: list[int] = field(default_factory=list)    # output tokens produced at each step
    running: list[int] = field(default_factory=list)       # running requests after each step's schedule
    waiting: list[int] = field(default_factory=list)       # requests still waiting after each step's schedule
    preemptions: int = 0

    @property
    def steps(self) -> int:
        return len(self.shapes)


def fake_forward(scheduler: Scheduler, plan: StepPlan) -> list[Request]:
    """The step update after a forward + sampler that samples token 0; returns the requests it finished (in a
    simulation, by reaching params.max_tokens: the engine's 'length' finish)."""
    return scheduler.update(plan, [(request, 0, None) for request in plan.sampling])


def make_scheduler(num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                   prefix_caching: bool) -> Scheduler:
    """One batch lane over one pool, as the engine builds it without an interactive lane."""
    return Scheduler.single_lane(BlockManager(num_blocks, block_size, prefix_caching), max_num_seqs,
                                 max_num_batched_tokens)


def admission_keys(items: list[WorkItem], bucketing: bool, window: int, longest_first: bool,
                   pilot: float = 0.0) -> list[tuple]:
    """The job runner's order keys: (window index, rank in the window's order) with bucketing, else arrival order."""
    if not bucketing:
        return [() for _ in items]
    keys: list[tuple] = [()] * len(items)
    for w, start in enumerate(range(0, len(items), window)):
        lengths = [item.prompt_len for item in items[start:start + window]]
        for rank, position in enumerate(window_order(lengths, longest_first, pilot if w == 0 else 0.0)):
            keys[start + position] = (w, rank)
    return keys


def dummy_prompt(seed: int, length: int) -> list[int]:
    """Token ids standing in for a prompt known only by its length; different seeds share no prefix block."""
    return [1 + (seed + j) % 30000 for j in range(length)]


def make_requests(items: list[WorkItem], keys: list[tuple] | None = None) -> list[Request]:
    """Fresh batch-lane requests for the items (an int prompt becomes distinct dummy ids, so nothing is shared)."""
    keys = keys or [()] * len(items)
    return [Request(str(i), list(item.prompt) if not isinstance(item.prompt, int) else dummy_prompt(i, item.prompt),
                    SamplingParams(max_tokens=item.output_tokens, temperature=0), order_key=keys[i], arrival_index=i)
            for i, item in enumerate(items) if item.output_tokens >= 1]


def place_running(scheduler: Scheduler, request: Request, computed: int, prompt_tokens: int) -> bool:
    """Put a request in the running batch with `computed` tokens in the cache, as the engine holds it mid-job: the
    full blocks of its prompt that a request placed before it holds are shared (the prefix cache shared them at
    admission), the rest its own. False when the pool cannot hold it (it then waits and recomputes, as after a
    preemption)."""
    lane = scheduler.lanes[-1]
    blocks = lane.block_manager
    hits = blocks.get_computed_blocks(request)[:max(min(computed, prompt_tokens - 1), 0) // blocks.block_size]
    if (len(lane.running) >= scheduler.max_num_seqs
            or not blocks.allocate_slots(request, computed - len(hits) * blocks.block_size, hits)):
        return False
    request.num_computed_tokens, request.status = computed, RequestStatus.RUNNING
    lane.block_manager.cache_full_blocks(request, computed)   # its blocks serve the prefix cache, as in the engine
    lane.running.append(request)
    return True


def simulate(items: list[WorkItem], num_blocks: int, block_size: int = 16, max_num_seqs: int = 128,
             max_num_batched_tokens: int = 1024, prefix_caching: bool = False, keys: list[tuple] | None = None,
             max_steps: int = 5_000_000) -> Trace:
    """Run every item through the real scheduler and block manager; the trace of step shapes.
    Prefix caching needs real token ids (an int prompt becomes distinct dummy ids, so nothing is shared)."""
    scheduler = make_scheduler(num_blocks, block_size, max_num_seqs, max_num_batched_tokens, prefix_caching)
    running = {str(i): item for i, item in enumerate(items) if item.computed}
    for request in make_requests(items, keys):
        item = running.get(request.request_id)
        if not (item and place_running(scheduler, request, item.computed, item.prompt_len - item.generated)):
            scheduler.add(request)
    trace = Trace()
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        if not plan.scheduled:
            raise RuntimeError("simulation: the scheduler planned no work; the pool cannot hold the next request "
                               f"({num_blocks} blocks of {block_size} tokens)")
        trace.shapes.append(StepShape.of(plan.scheduled, block_size))
        trace.running.append(len(scheduler.running))
        trace.waiting.append(scheduler.num_waiting)
        trace.out_tokens.append(len(plan.sampling))
        trace.finished.append(len(fake_forward(scheduler, plan)))
        if trace.steps > max_steps:
            raise RuntimeError(f"simulation: more than {max_steps} steps; the job is too large to simulate whole")
    trace.preemptions = scheduler.num_preemptions
    return trace


@dataclass
class Timeline:
    makespan_s: float
    drain_s: float            # from the last admission (waiting queue empty) to the end
    output_tokens: int
    step_times: list[float]
    finished: list[int]       # requests finished at each step

    def progress(self, points: int = 200) -> list[tuple[float, float]]:
        """(seconds, fraction of requests finished): the job's predicted progress over time, for plots."""
        total, steps, acc, done, out = max(sum(self.finished), 1), len(self.step_times), 0.0, 0, [(0.0, 0.0)]
        stride = max(1, steps // points)
        for i, (t, f) in enumerate(zip(self.step_times, self.finished)):
            acc, done = acc + t, done + f
            if i % stride == 0 or i == steps - 1:
                out.append((acc, done / total))
        return out


def timeline(trace: Trace, step_time) -> Timeline:
    """Price every step of the trace with a step-time model (a callable StepShape -> seconds)."""
    times = [step_time(s) for s in trace.shapes]
    last_wait = max((i for i, w in enumerate(trace.waiting) if w), default=-1)
    return Timeline(makespan_s=sum(times), drain_s=sum(times[last_wait + 1:]), output_tokens=sum(trace.out_tokens),
                    step_times=times, finished=trace.finished)
