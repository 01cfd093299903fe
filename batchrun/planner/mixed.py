"""Mixed-SLA planning: interactive traffic with p95 latency targets next to the batch job and its deadline.

Per GPU type, two layouts over the deadline window (every pool held for the whole window, as a fleet reserved for
the night):
- shared: every GPU runs batchrun's two lanes, an interactive lane (float16 KV, a reserve of blocks, a capped share
  of each step's tokens) and the batch lane (packed 8-bit KV), over its shard of the job while its share of the
  interactive traffic arrives;
- two pools: a float16 latency pool sized for the traffic plus headroom, next to the packed throughput pool that the
  batch plan sized for the deadline.
Both are time-driven discrete-event simulations over the engine's real scheduler and block managers: requests arrive
(Poisson, fixed seed), each step is priced by the roofline cost model, the clock advances by the step's time.
"""
from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field

import numpy as np

from batchrun.engine.block_manager import BlockManager
from batchrun.engine.request import Request
from batchrun.engine.scheduler import Lane, Scheduler, WaitingQueue
from batchrun.engine.step_stats import StepShape
from batchrun.sampling_params import SamplingParams
from batchrun.stepmodel.catalog import GPU
from batchrun.stepmodel.costmodel import RooflineModel
from batchrun.stepmodel.simulate import dummy_prompt, fake_forward

LATENCY_KV_DTYPE = "float16"
PACKED_KV_DTYPES = ("int8", "fp8")   # batch KV in the shared pool and the throughput pool
INTERACTIVE_TOKEN_SHARE = 0.5   # the engine's default interactive_token_share
MIN_INTERACTIVE_SEATS = 8       # the engine's default interactive_max_num_seqs
MIN_SHARED_TOKEN_BUDGET = 256   # the smallest step token budget tried for the shared pool
LATENCY_POOL_ARRIVALS = 400     # simulated requests per latency-pool candidate
_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0}


def parse_latency(value, field: str) -> float:
    """'500ms', '0.5s', '2s' or a number of seconds -> seconds (> 0)."""
    text = str(value).strip().lower()
    unit = next((u for u in ("ms", "s", "m") if text.endswith(u)), "")
    try:
        seconds = float(text[:len(text) - len(unit)]) * _UNITS.get(unit, 1.0)
    except ValueError:
        raise ValueError(f"{field}: cannot parse {value!r}; use a duration such as 500ms or 1.5s") from None
    if not seconds > 0:
        raise ValueError(f"{field}: must be a positive duration, got {value!r}")
    return seconds


@dataclass(frozen=True)
class Traffic:
    """Interactive traffic for the whole fleet and its latency targets."""
    rate: float              # requests per second
    prompt_tokens: int
    output_tokens: int
    ttft_p95_s: float
    tpot_p95_s: float
    headroom: float = 0.2    # the latency pool is sized for rate x (1 + headroom)

    def __post_init__(self):
        for name in ("rate", "prompt_tokens", "output_tokens"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--interactive-{name.replace('_', '-')}: must be positive, "
                                 f"got {getattr(self, name)!r}")
        if not self.headroom >= 0:   # NaN too
            raise ValueError(f"--headroom: must be >= 0, got {self.headroom!r}")

    @property
    def request_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass
class Served:
    """What one simulated GPU did: latencies of its interactive requests and when its batch shard finished."""
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    batch_makespan_s: float | None = None

    @property
    def ttft_p95(self) -> float:
        return float(np.percentile(self.ttft, 95)) if self.ttft else 0.0

    @property
    def tpot_p95(self) -> float:
        return float(np.percentile(self.tpot, 95)) if self.tpot else 0.0

    def meets(self, traffic: Traffic) -> bool:
        return self.ttft_p95 <= traffic.ttft_p95_s and self.tpot_p95 <= traffic.tpot_p95_s


def make_lane(name: str, num_blocks: int, block_size: int, max_seqs: int, token_cap: int,
              prefix_caching: bool) -> Lane:
    return Lane(name, BlockManager(num_blocks, block_size, prefix_caching), max_seqs, token_cap, WaitingQueue())


def serve(scheduler: Scheduler, cost: RooflineModel, lane_bytes: dict[str, int], traffic: Traffic, rate: float,
          batch: list[Request] = (), arrivals: int | None = None, seed: int = 0) -> Served:
    """Run the batch requests while interactive requests arrive at `rate` (until the batch is done, or for
    `arrivals` requests without a batch); each step costs the cost model's time for its shape, the KV read priced
    per lane at that lane's bytes per token."""
    rng, served, now = random.Random(seed), Served(), 0.0
    for request in batch:
        scheduler.add(request)
    batch_left, sent = len(batch), 0
    next_arrival = rng.expovariate(rate)

    def arriving() -> bool:
        return batch_left > 0 if batch else sent < arrivals

    while True:
        while arriving() and next_arrival <= now:
            ids = dummy_prompt(sent * 7919, traffic.prompt_tokens)
            scheduler.add(Request(f"i{sent}", ids, SamplingParams(max_tokens=traffic.output_tokens, temperature=0),
                                  lane="interactive", arrival_time=next_arrival))
            sent += 1
            next_arrival += rng.expovariate(rate)
        if not scheduler.has_unfinished():
            if not arriving():
                return served
            now = next_arrival
            continue
        plan = scheduler.schedule()
        if not plan.scheduled:
            raise RuntimeError("mixed simulation: the scheduler planned no work; a pool cannot hold the next request")
        kv_bytes = sum((r.num_computed_tokens + n) * lane_bytes[r.lane] for r, n in plan.scheduled)
        now += cost.step_time(dataclasses.replace(StepShape.of(plan.scheduled), kv_bytes=kv_bytes))
        finished = fake_forward(scheduler, plan)
        for request, _ in plan.scheduled:
            if request.first_token_time is None and request.num_tokens > request.num_prompt_tokens:
                request.first_token_time = now
        for request in finished:
            if request.lane == "interactive":
                served.ttft.append(request.first_token_time - request.arrival_time)
                if traffic.output_tokens > 1:
                    served.tpot.append((now - request.first_token_time) / (traffic.output_tokens - 1))
            else:
                batch_left -= 1
                if not batch_left:
                    served.batch_makespan_s = now


def smallest(feasible, start: int, cap: int) -> int | None:
    """The smallest n >= start with feasible(n), assuming feasibility is monotone in n (doubling, then bisection)."""
    if feasible(start):
        return start
    low, high = start, start
    while True:
        if high >= cap:
            return None
        low, high = high, min(high * 2, cap)
        if feasible(high):
            break
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if feasible(mid) else (mid, high)
    return high


class MixedPlanner:
    """Sizes both layouts for one GPU type, given the batch plan's rows (planner.Planner) for that type."""

    def __init__(self, planner, traffic: Traffic, max_gpus: int):
        self.p, self.traffic, self.max_gpus = planner, traffic, max_gpus
        w = planner.work
        self.block_size = w.block_size
        self.request_blocks = -(-traffic.request_tokens // w.block_size)

    def rows(self, gpu: GPU, batch_rows: list[dict]) -> list[dict]:
        """Both layouts for each 8-bit batch KV dtype among the GPU's batch rows (int8 when none was asked for)."""
        budget = self.p.kv_budget(gpu)
        if budget <= 0:
            return []
        latency = self._latency_pool(gpu, budget)
        packed = [r for r in batch_rows if r["kv_dtype"] in PACKED_KV_DTYPES] or [self.p.row(gpu, "int8")]
        packed = [r for r in packed if r.get("fits")]
        rows = []
        for batch in packed:
            rows.append(self._shared(gpu, budget, batch))
            rows.append(self._two_pools(gpu, batch, latency))
        return rows

    # --- the float16 latency pool -------------------------------------------------------------------------------
    def _latency_pool(self, gpu: GPU, budget: int) -> dict:
        t, w = self.traffic, self.p.work
        bpt = self.p.kv_bytes_per_token(LATENCY_KV_DTYPE)
        cost = self.p.cost_model(gpu, bpt)
        blocks = budget // (bpt * self.block_size)
        if blocks < self.request_blocks:
            return {"gpus": None, "reason": f"one interactive request ({t.request_tokens} tokens) does not fit the "
                                            f"{LATENCY_KV_DTYPE} KV budget"}
        idle = self._idle_limits(cost)
        if idle:
            return {"gpus": None, "reason": idle}
        blocks = min(blocks, w.max_num_seqs * self.request_blocks)   # more than every seat can use changes nothing
        results: dict[int, Served] = {}

        def feasible(n: int) -> bool:
            lane = make_lane("interactive", blocks, self.block_size, w.max_num_seqs, w.max_num_batched_tokens,
                             w.prefix_caching)
            results[n] = serve(Scheduler([lane], w.max_num_seqs, w.max_num_batched_tokens), cost,
                               {"interactive": bpt}, t, t.rate * (1 + t.headroom) / n, arrivals=LATENCY_POOL_ARRIVALS)
            return results[n].meets(t)

        n = smallest(feasible, 1, self.max_gpus)
        if n is None:
            return {"gpus": None, "reason": f"{self.max_gpus} GPUs do not meet the latency targets"}
        return {"gpus": n, "ttft_p95_s": results[n].ttft_p95, "tpot_p95_s": results[n].tpot_p95}

    def _idle_limits(self, cost: RooflineModel) -> str | None:
        """A target that one request alone on an idle GPU misses: no number of GPUs helps."""
        t, w = self.traffic, self.p.work
        chunks = [min(w.max_num_batched_tokens, t.prompt_tokens - s) for s in range(0, t.prompt_tokens,
                                                                                    w.max_num_batched_tokens)]
        ttft = sum(cost.step_time(StepShape(c, 1, s + c, c * s + c * (c + 1) // 2))
                   for c, s in zip(chunks, range(0, t.prompt_tokens, w.max_num_batched_tokens)))
        tpot = cost.decode_step(1, t.request_tokens)
        if ttft > t.ttft_p95_s:
            return f"one {t.prompt_tokens}-token prompt on an idle GPU takes {ttft * 1e3:.0f} ms to its first token"
        if tpot > t.tpot_p95_s:
            return f"one decode step on an idle GPU takes {tpot * 1e3:.1f} ms"
        return None

    # --- one shared pool with two lanes -------------------------------------------------------------------------
    def _shared(self, gpu: GPU, budget: int, batch_row: dict) -> dict:
        """The fewest GPUs over a few step token budgets: a smaller budget shortens the batch's prefill chunks,
        which sit in the same steps as interactive decodes (TPOT), at some cost in batch throughput."""
        lane_bytes = {"interactive": self.p.kv_bytes_per_token(LATENCY_KV_DTYPE),
                      "batch": batch_row["kv_bytes_per_token"]}
        cost = self.p.cost_model(gpu, lane_bytes["batch"])
        row = {"gpu": gpu.name, "layout": "shared", "batch_kv_dtype": batch_row["kv_dtype"],
               "price_per_hour": gpu.price_per_hour}
        idle = self._idle_limits(cost)
        if idle or not batch_row.get("gpus"):
            return row | {"gpus": None, "reason": idle or batch_row.get("reason", "the batch job does not fit")}
        best = None
        for tokens in self._token_budgets():
            found = self._size_shared(cost, lane_bytes, budget, tokens, batch_row["gpus"])
            if found and (best is None or found[0] < best[0]):
                best = found
        if best is None:
            return row | {"gpus": None, "reason": "no fleet size meets both the deadline and the latency targets"}
        n, served, seats, tokens = best
        return row | {"gpus": n, "interactive_seats": seats, "max_num_batched_tokens": tokens,
                      "ttft_p95_s": served.ttft_p95, "tpot_p95_s": served.tpot_p95,
                      "batch_makespan_s": served.batch_makespan_s, **self._cost(gpu, n)}

    def _token_budgets(self) -> list[int]:
        tokens = self.p.work.max_num_batched_tokens
        return [tokens] + [tokens >> k for k in (1, 2) if tokens >> k >= MIN_SHARED_TOKEN_BUDGET]

    def _size_shared(self, cost: RooflineModel, lane_bytes: dict[str, int], budget: int, tokens: int,
                     start: int) -> tuple[int, Served, int, int] | None:
        t, w = self.traffic, self.p.work
        results: dict[int, tuple[Served, int]] = {}

        def feasible(n: int) -> bool:
            seats = self._interactive_seats(cost, t.rate / n)
            reserve = seats * self.request_blocks
            batch_blocks = (budget - reserve * self.block_size * lane_bytes["interactive"]) // (
                lane_bytes["batch"] * self.block_size)
            if batch_blocks < -(-self.p.longest // self.block_size):
                return False
            lanes = [make_lane("interactive", reserve, self.block_size, seats,
                               max(1, int(tokens * INTERACTIVE_TOKEN_SHARE)), w.prefix_caching),
                     make_lane("batch", min(batch_blocks, self.p.block_cap), self.block_size, w.max_num_seqs, tokens,
                               w.prefix_caching)]
            served = serve(Scheduler(lanes, w.max_num_seqs + seats, tokens), cost, lane_bytes, t, t.rate / n,
                           batch=self.p.batch_requests(n))
            results[n] = (served, seats)
            return served.meets(t) and served.batch_makespan_s <= self.p.deadline

        n = smallest(feasible, start, self.max_gpus)
        return None if n is None else (n, *results[n], tokens)

    def _interactive_seats(self, cost: RooflineModel, rate: float) -> int:
        """Seats for twice the requests in flight by Little's law at an idle request's duration, at least the
        engine's default; the lane's block reserve holds that many requests whole."""
        t = self.traffic
        duration = (cost.prefill_step(t.prompt_tokens) + (t.output_tokens - 1)
                    * cost.decode_step(self.p.work.max_num_seqs, t.request_tokens))
        return max(MIN_INTERACTIVE_SEATS, math.ceil(2 * rate * duration))

    # --- a latency pool next to the throughput pool ---------------------------------------------------------------
    def _two_pools(self, gpu: GPU, batch_row: dict, latency: dict) -> dict:
        row = {"gpu": gpu.name, "layout": "two pools", "batch_kv_dtype": batch_row["kv_dtype"],
               "price_per_hour": gpu.price_per_hour}
        if latency["gpus"] is None or not batch_row.get("gpus") or not batch_row.get("meets_deadline"):
            return row | {"gpus": None, "reason": latency.get("reason") or batch_row.get("reason")
                          or "the batch pool misses the deadline"}
        n = latency["gpus"] + batch_row["gpus"]
        return row | {"gpus": n, "latency_gpus": latency["gpus"], "batch_gpus": batch_row["gpus"],
                      "max_num_batched_tokens": self.p.work.max_num_batched_tokens,
                      "ttft_p95_s": latency["ttft_p95_s"], "tpot_p95_s": latency["tpot_p95_s"],
                      "batch_makespan_s": batch_row["makespan_s"], **self._cost(gpu, n)}

    def _cost(self, gpu: GPU, n: int) -> dict:
        hours = n * self.p.deadline / 3600
        return {"gpu_hours": hours, "cost_usd": hours * gpu.price_per_hour}


def recommend_mixed(rows: list[dict]) -> dict | None:
    ok = sorted((r for r in rows if r.get("gpus")), key=lambda r: (r["cost_usd"], r["gpus"]))
    if not ok:
        return None
    best = ok[0]
    other = next((r for r in ok if r["layout"] != best["layout"]), None)
    reason = (f"cheapest layout that meets the deadline and the latency targets: {best['layout']} on "
              f"{best['gpus']} x {best['gpu']} (batch KV {best['batch_kv_dtype']}), ${best['cost_usd']:.4g} "
              f"over the window")
    if other:
        reason += (f"; the best {other['layout']} layout needs {other['gpus']} x {other['gpu']} "
                   f"(${other['cost_usd']:.4g}, {(other['cost_usd'] / best['cost_usd'] - 1) * 100:+.0f}%)")
    return {"layout": best["layout"], "gpu": best["gpu"], "gpus": best["gpus"],
            "batch_kv_dtype": best["batch_kv_dtype"], "reason": reason}
