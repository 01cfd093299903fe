"""The step loop: schedule -> forward -> sample -> update, over a paged KV pool."""
from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import logging
import time
from typing import Callable

import torch

from batchrun.config import EngineConfig
from batchrun.engine import cpu_dtype, kv_cache, kv_sizing, loader
from batchrun.engine.block_manager import BlockManager
from batchrun.engine.model_build import build_model
from batchrun.engine.model_runner import ModelRunner
from batchrun.engine.request import Request, RequestOutput
from batchrun.engine.sampler import Sampler
from batchrun.engine.sampling_isolation import accept_into_grammar, sample_alone_on_failure
from batchrun.engine.scheduler import Lane, Scheduler, WaitingQueue, default_admission_key
from batchrun.engine.step_stats import PhaseClock, StepShape, StepStats
from batchrun.engine.step_threads import StepThreads
from batchrun.engine.stop import StopRule
from batchrun.engine.warm_up import warm_up
from batchrun.models import cpu_gemm
from batchrun.quant import formats as quant_formats
from batchrun.sampling_params import SamplingParams, sample_seed
from batchrun.structured import GrammarCompiler

log = logging.getLogger("batchrun")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class Engine:
    def __init__(self, config: EngineConfig, admission_key: Callable[[Request], tuple] = default_admission_key):
        self.config = config
        self.device = torch.device(config.device if config.device != "auto"
                                   else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model_path = loader.resolve_model_path(config.model)
        self.hf_config = loader.load_config(self.model_path, config.trust_remote_code)
        self.quant_scheme = quant_formats.scheme_for(self.hf_config, config.quantization, self.device.type,
                                                     config.quantization_rotation, config.quantization_lm_head)
        self.tokenizer = loader.load_tokenizer(config.tokenizer or self.model_path, config.trust_remote_code)
        self.dtype = self._compute_dtype()
        self.kv_dtype = kv_cache.storage_dtype(config.kv_cache_dtype, self.dtype)   # the batch lane's
        self.max_model_len = loader.max_model_len(self.hf_config, config.max_model_len)

        if config.tensor_parallel_size > 1:   # rank 0 of a tensor-parallel group: starts the other ranks
            if self.quant_scheme is not None:
                raise ValueError(f"tensor_parallel_size: {config.tensor_parallel_size} ranks with quantized weights "
                                 f"({self.quant_scheme.description}) is not supported yet")
            from batchrun.engine.parallel.runner import TensorParallelRunner
            self.runner = TensorParallelRunner(config, self.model_path, self.hf_config, self.device, self.dtype,
                                               self.max_model_len)
            self.adapters = None
        else:
            model, self.adapters = build_model(config, self.model_path, self.hf_config, self.device, self.dtype,
                                               self.max_model_len, quant_scheme=self.quant_scheme)
            self.runner = ModelRunner(model, config.block_size, self.device, self.adapters)
        self.model = self.runner.model
        self.scheduler = Scheduler(self._build_lanes(admission_key), config.max_num_seqs,
                                   config.max_num_batched_tokens,
                                   StopRule(self._eos_token_ids(), self.max_model_len, self.tokenizer),
                                   max_adapters=config.max_adapters if self.adapters else None)
        self.sampler = Sampler(config.seed)
        self.stats = StepStats(kv_blocks_free=self.num_blocks)
        self._observers: list[tuple[Callable[[StepStats], None], bool]] = []
        self.requests: dict[str, list[Request]] = {}   # request id -> its samples (one unless params.n > 1)
        self._grammars: GrammarCompiler | None = None   # built at the first structured-output request
        self._rejected: list[Request] = []
        self._ids = itertools.count()
        self.step_threads: StepThreads | None = None   # set while serving on the CPU (LLM.start_background)
        self.one_thread_warm = False   # whether the graph is built for steps on one thread (StepThreads.warm_up)
        if getattr(self.model, "graph_compiled", False):   # built now, not at the first real step
            self.warm_up()

    def warm_up(self) -> None:
        """A few short requests through the whole-model graph (warm_up.py). Their request ids, steps and cache
        hits are not the user's: the engine keeps the counts it had, and its observers do not see them."""
        next_id, stats = next(self._ids), copy.deepcopy(self.stats)
        hits = [lane.block_manager.prefix_hits for lane in self.scheduler.lanes]
        observers, self._observers = self._observers, []
        try:
            warm_up(self)
        finally:
            self._observers = observers
        self._ids, self.stats = itertools.count(next_id), stats
        for lane, count in zip(self.scheduler.lanes, hits):
            lane.block_manager.prefix_hits = count

    def _build_lanes(self, admission_key) -> list[Lane]:
        """The batch lane, and the interactive lane's own pool when enabled; sizes logged for capacity planning."""
        config, attn = self.config, self.model.model.layers[0].self_attn
        budget, field = kv_sizing.total_kv_budget(config, self.device, lambda: self.runner.dummy_forward(
            min(config.max_num_batched_tokens, self.max_model_len), config.max_num_seqs, self.kv_dtype))
        if self.adapters is not None:
            log.info("LoRA adapters: %d, at most %d resident, %.1f MiB reserved", len(self.adapters.files),
                     config.max_adapters, self.adapters.reserved_bytes / 2**20)
            if field == "gpu_memory_utilization":   # the profiled peak held no adapter yet
                budget = max(0, budget - self.adapters.reserved_bytes)
        specs = kv_sizing.lane_specs(config, budget, field)
        # LongRoPE keys depend on the sequence's length, not only on its tokens: a cached prefix is not reusable.
        prefix_caching = config.enable_prefix_caching and self.model.long_rope_after is None
        if prefix_caching != config.enable_prefix_caching:
            log.info("prefix caching: off for this model (LongRoPE keys change once a sequence outgrows %d tokens)",
                     self.model.long_rope_after)
        lanes, pools = [], []
        for spec in specs:
            dtype = kv_cache.storage_dtype(spec.kv_dtype, self.dtype)
            per_token = kv_cache.bytes_per_token(self.hf_config.num_hidden_layers, attn.num_kv_heads, attn.head_dim,
                                                 dtype)
            label = spec.kv_dtype if spec.kv_dtype != "auto" else str(dtype).removeprefix("torch.")
            num_blocks = kv_sizing.blocks_for(spec.kv_bytes, per_token, config.block_size, self.max_model_len,
                                              spec.budget_field, label)
            tokens = num_blocks * config.block_size
            log.info("KV cache [%s lane]: %d blocks x %d tokens = %d tokens, %.3f GiB, dtype %s, %d bytes/token, "
                     "max concurrency %d at max context %d", spec.name, num_blocks, config.block_size, tokens,
                     tokens * per_token / 2**30, label, per_token, tokens // self.max_model_len, self.max_model_len)
            if spec.name == "batch":
                self.kv_bytes_per_token = per_token
            lanes.append(Lane(spec.name, BlockManager(num_blocks, config.block_size, prefix_caching),
                              spec.max_num_seqs, spec.token_cap, WaitingQueue(admission_key), yield_cap=spec.yield_cap))
            pools.append((num_blocks, dtype))
        self.runner.allocate_kv(pools)
        self._pool_index = {lane.name: i for i, lane in enumerate(lanes)}
        return lanes

    def _compute_dtype(self) -> torch.dtype:
        if self.config.dtype != "auto":
            return _DTYPES[self.config.dtype]   # EngineConfig checked the name
        if self.device.type == "cpu":
            dtype, why = cpu_dtype.auto_cpu_dtype()
            log.info("compute dtype (auto) %s", why)
            return dtype
        model_dtype = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
        return model_dtype if model_dtype in (torch.float16, torch.bfloat16) else torch.float16

    def _eos_token_ids(self) -> frozenset[int]:
        ids = getattr(self.hf_config, "eos_token_id", None)
        ids = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
        ids |= loader.generation_eos_ids(self.model_path)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    def close(self) -> None:
        """Stop the tensor-parallel worker ranks and leave their process group (nothing to do on one rank)."""
        if hasattr(self.runner, "close"):
            self.runner.close()

    @property
    def block_manager(self) -> BlockManager:
        """The batch lane's block manager."""
        return self.scheduler.lanes[-1].block_manager

    @property
    def num_blocks(self) -> int:
        return sum(lane.block_manager.num_blocks for lane in self.scheduler.lanes)

    def _lane_name(self, lane: str) -> str:
        """The lane a request asks for; "interactive" is the batch lane where none is configured (one pool)."""
        if lane in self._pool_index:
            return lane
        if lane == "interactive":
            return "batch"
        raise ValueError(f"lane: unknown lane {lane!r}; this engine has {', '.join(self._pool_index)}")

    def _pool_of(self, request: Request) -> int:
        return self._pool_index[request.lane]

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    lane: str = "batch", priority: int = 0, order_key: tuple = ()) -> Request:
        """Queue a request. One that cannot run is finished at once with finish_reason 'error'."""
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in the engine")
        request = Request(request_id, list(prompt_token_ids), params, self._lane_name(lane), priority, order_key)
        self.requests[request_id] = [request]
        error = self._check_request(request) or self._attach_grammar(request)
        if error:
            self._finish(request, "error", error)
            self._rejected.append(request)
        else:
            self.scheduler.add(request)
        return request

    def _check_request(self, request: Request) -> str | None:
        n = request.num_prompt_tokens
        vocab = self.hf_config.vocab_size
        if n == 0:
            return "prompt: empty prompt"
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in request.prompt_token_ids):
            return f"prompt: token ids must be integers in [0, {vocab})"
        if n >= self.max_model_len:
            return f"prompt: {n} tokens does not fit the context of {self.max_model_len} tokens (max_model_len)"
        adapter = request.adapter
        if adapter is not None and (self.adapters is None or adapter not in self.adapters):
            known = ", ".join(self.adapters.files) if self.adapters else "none"
            return f"adapter: unknown adapter {adapter!r} (this engine has: {known})"
        return None   # the pool holds one request at max context (checked at start-up): it always fits alone

    def _attach_grammar(self, request: Request) -> str | None:
        """Give a structured-output request its matcher; the error when that cannot be."""
        constraint = request.params.constraint
        if constraint is None:
            return None
        if self.tokenizer is None:
            return "structured output: this model has no tokenizer to match the grammar against"
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.hf_config.vocab_size, sorted(self._eos_token_ids()))
        try:
            request.grammar = self._grammars.matcher(*constraint)
        except Exception as exc:   # noqa: BLE001 -- e.g. a schema that parses but does not compile for this vocabulary
            return f"{constraint[0]}: cannot be compiled for this model's vocabulary ({exc})"
        return None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._rejected)

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Stop a request (every sample of it) and free its blocks; returns the final outputs of the samples it
        stopped (none if unknown or finished)."""
        samples = [r for r in self.requests.get(request_id, []) if not r.finished]
        for request in samples:
            self._finish(request, "abort")
        return [self._output(r) for r in samples]

    def reset_prefix_cache(self) -> int:
        """Forget the cached prompt blocks that no request holds, in every lane (the next prompts are computed
        anew, as on a fresh engine: a benchmark's repeated runs); returns how many blocks were forgotten."""
        return sum(lane.block_manager.reset_prefix_cache() for lane in self.scheduler.lanes)

    def observe(self, callback: Callable[[StepStats], None], synchronize: bool = False) -> Callable[[], None]:
        """Call `callback(stats)` after every step (the same StepStats object, updated in place: copy what you keep).
        synchronize: wait for the device at each phase boundary so that the phase times are the device's (slower
        on CUDA; no effect on CPU). Returns the function that stops the observing."""
        entry = (callback, synchronize)
        self._observers.append(entry)
        return lambda: self._observers.remove(entry) if entry in self._observers else None

    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output for each request that got a token or finished.

        A request that fails after the forward (its grammar, its sampling, its stop rule) ends alone with
        finish_reason 'error' and its reason; the step goes on for the others. A forward that raises is the
        engine's failure: it propagates."""
        synchronized = self.device.type == "cuda" and any(sync for _, sync in self._observers)
        clock = PhaseClock(functools.partial(torch.cuda.synchronize, self.device) if synchronized else None)
        touched = self._rejected
        self._rejected = []
        plan = self.scheduler.schedule()
        shape = StepShape.of(plan.scheduled, self.config.block_size)   # read before update advances the requests
        if self.step_threads is not None:
            self.step_threads.before_step(shape.tokens)
        clock.lap("schedule_s")
        if plan.scheduled:
            self.stats.prompt_tokens += plan.num_prompt_tokens
            try:
                logits, sample_reqs = self.runner.run(plan, self._pool_of)
            except BaseException:   # Ctrl-C included: generate() keeps the engine usable after it
                self.scheduler.unplan(plan)
                raise
            clock.lap("forward_s")
            failed: dict[Request, str] = {}   # request -> why it ends now, alone
            logits, sample_reqs = self._fork(logits, sample_reqs, failed)
            if self._grammars is not None:
                dead = self._grammars.mask(logits, [r.grammar for r in sample_reqs])
                failed.update((sample_reqs[i], why) for i, why in dead.items())
            sampled = sample_alone_on_failure(self.sampler, logits, sample_reqs, failed)
            sampled = [s for s in sampled if accept_into_grammar(s[0], s[1], failed)]
            clock.lap("sample_s")
            finished = self.scheduler.update(plan, sampled)
            for request, why in failed.items():
                self._finish(request, "error", why)
            now = time.monotonic()
            for request in sample_reqs:
                if request.first_token_time is None and request not in failed:
                    request.first_token_time = now
            for request in finished:
                self._finalize(request)
            touched.extend(sample_reqs)
            self.stats.output_tokens += len(sampled)
        elif not touched and self.scheduler.running:
            raise RuntimeError("scheduler planned no work while requests are running")
        clock.lap("update_s")
        if self.step_threads is not None:
            self.step_threads.after_step(clock.total)
        self._update_stats(shape, clock)
        for callback, _ in list(self._observers):
            callback(self.stats)
        if self.device.type == "cpu":
            cpu_gemm.return_freed_memory()
        return [self._output(r) for r in touched]

    def _fork(self, logits: torch.Tensor, sample_reqs: list[Request],
              failed: dict[Request, str]) -> tuple[torch.Tensor, list[Request]]:
        """Prompts sampled for the first time with n > 1: their other samples join, sharing the prompt's KV blocks
        and sampling their first token from the prompt's logits row."""
        if not any(r.forks_pending for r in sample_reqs):
            return logits, sample_reqs
        rows, requests = [], []
        for row, request in enumerate(sample_reqs):
            rows.append(row)
            requests.append(request)
            if request.forks_pending:
                siblings = [self._sibling(request, k, failed) for k in range(1, request.params.n)]
                # LongRoPE rewrites a sequence's keys once it outgrows the original context: nothing is shared
                copies = self.scheduler.fork(request, siblings, share=self.model.long_rope_after is None)
                if copies:
                    self.runner.copy_blocks(self._pool_of(request), copies)
                rows += [row] * len(siblings)
                requests += siblings
        return logits[torch.tensor(rows, device=logits.device)], requests

    def _sibling(self, parent: Request, index: int, failed: dict[Request, str]) -> Request:
        """Sample `index` of the parent's prompt: its own generator (seed + index when the prompt has a seed) and
        its own grammar matcher."""
        params = parent.params
        if params.seed is not None:
            params = dataclasses.replace(params, seed=sample_seed(params.seed, index))
        sibling = Request(parent.request_id, list(parent.prompt_token_ids), params, parent.lane, parent.priority,
                          parent.order_key, arrival_time=parent.arrival_time, sample_index=index)
        sibling.prompt_logprobs = list(parent.prompt_logprobs)
        error = self._attach_grammar(sibling)
        if error:
            failed[sibling] = error
        self.requests[parent.request_id].append(sibling)
        return sibling

    def _finish(self, request: Request, reason: str, error: str | None = None) -> None:
        """End a request outside the step's stop rules (rejected or aborted)."""
        self.scheduler.finish(request, reason)
        request.error = error
        self._finalize(request)

    def _finalize(self, request: Request) -> None:
        request.finish_time = time.monotonic()
        if request.text is None and self.tokenizer is not None and request.finish_reason != "error":
            request.text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)

    def _output(self, request: Request) -> RequestOutput:
        """The request's output now. When it is the last of its prompt's samples to finish, the output carries the
        final outputs of all of them (prompt_outputs, by sample_index), and the engine forgets the prompt."""
        out = RequestOutput.of(request)
        samples = self.requests.get(request.request_id, [])
        if out.finished and len(samples) == request.num_samples and all(r.finished for r in samples):
            del self.requests[request.request_id]
            out.prompt_outputs = [out if r is request else RequestOutput.of(r)
                                  for r in sorted(samples, key=lambda r: r.sample_index)]
        return out

    def _update_stats(self, shape: StepShape, clock: "PhaseClock") -> None:
        s = self.stats
        s.step += 1
        lanes = self.scheduler.lanes
        s.shape, s.running, s.waiting = shape, len(self.scheduler.running), self.scheduler.num_waiting
        s.kv_blocks_free = sum(lane.block_manager.num_free_blocks for lane in lanes)
        s.kv_blocks_used = self.num_blocks - s.kv_blocks_free
        s.prefix_cache_hit_tokens = sum(lane.block_manager.prefix_hits for lane in lanes)
        s.preemptions = self.scheduler.num_preemptions
        for phase, seconds in clock.laps.items():
            setattr(s, phase, seconds)
        s.step_time = clock.total

