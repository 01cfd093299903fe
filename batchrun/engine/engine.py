"""The step loop: schedule -> forward -> sample -> update, over a paged KV pool."""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from batchrun.config import EngineConfig
from batchrun.engine import kv_cache, loader
from batchrun.engine.attention import get_backend
from batchrun.engine.block_manager import BlockManager
from batchrun.engine.model_runner import ModelRunner
from batchrun.engine.request import Request, RequestOutput, RequestStatus
from batchrun.engine.sampler import Sampler
from batchrun.engine.scheduler import Scheduler, default_admission_key
from batchrun.models.llama import LlamaForCausalLM, fuse_checkpoint
from batchrun.sampling_params import SamplingParams

log = logging.getLogger("batchrun")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_CPU_KV_BYTES = 2 * 2**30


@dataclass
class StepStats:
    step: int = 0
    running: int = 0
    waiting: int = 0
    scheduled_tokens: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    prefix_cache_hit_tokens: int = 0   # cumulative
    preemptions: int = 0               # cumulative
    prompt_tokens: int = 0             # cumulative, processed (recompute included)
    output_tokens: int = 0             # cumulative
    step_time: float = 0.0


class Engine:
    def __init__(self, config: EngineConfig, admission_key: Callable[[Request], tuple] = default_admission_key):
        self.config = config
        self.device = torch.device(config.device if config.device != "auto"
                                   else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model_path = loader.resolve_model_path(config.model)
        self.hf_config = loader.load_config(self.model_path, config.trust_remote_code)
        self.tokenizer = loader.load_tokenizer(config.tokenizer or self.model_path, config.trust_remote_code)
        self.dtype = self._compute_dtype()
        self.kv_dtype = kv_cache.storage_dtype(config.kv_cache_dtype, self.dtype)
        self.max_model_len = self._max_model_len()

        with torch.device("meta"):
            self.model = LlamaForCausalLM(self.hf_config, get_backend(config.attention_backend, self.device))
        weights = loader.load_weights(self.model_path, self.device, self.dtype)
        self.model.load_state_dict(fuse_checkpoint(weights, getattr(self.hf_config, "tie_word_embeddings", False)),
                                   assign=True)
        self.model.init_rope(self.max_model_len, self.device, self.dtype)
        self.model.eval()

        attn = self.model.model.layers[0].self_attn
        self.kv_bytes_per_token = kv_cache.bytes_per_token(self.hf_config.num_hidden_layers, attn.num_kv_heads,
                                                           attn.head_dim, self.kv_dtype)
        self.runner = ModelRunner(self.model, config.block_size, self.kv_dtype, self.device)
        num_blocks = self._num_kv_blocks()
        self.runner.allocate_kv(num_blocks)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, admission_key)
        self.sampler = Sampler(config.seed)
        self.eos_token_ids = self._eos_token_ids()
        self.stats = StepStats(kv_blocks_free=num_blocks)
        self.requests: dict[str, Request] = {}
        self._rejected: list[Request] = []
        self._ids = itertools.count()
        tokens = num_blocks * config.block_size
        log.info("KV cache: %d blocks x %d tokens = %d tokens, %.3f GiB, dtype %s, %d bytes/token, "
                 "max concurrency %d at max context %d", num_blocks, config.block_size, tokens,
                 tokens * self.kv_bytes_per_token / 2**30, config.kv_cache_dtype if config.kv_cache_dtype != "auto"
                 else str(self.kv_dtype).removeprefix("torch."), self.kv_bytes_per_token,
                 tokens // self.max_model_len, self.max_model_len)

    def _num_kv_blocks(self) -> int:
        """From kv_cache_memory; on CUDA without it, what the device has left after a profiled peak step."""
        config = self.config
        if config.kv_cache_bytes is None and self.device.type == "cuda":
            budget, field = self._profile_cuda_budget(), "gpu_memory_utilization"
        else:
            budget, field = config.kv_cache_bytes or DEFAULT_CPU_KV_BYTES, "kv_cache_memory"
        block_bytes = self.kv_bytes_per_token * config.block_size
        num_blocks = budget // block_bytes
        needed = -(-self.max_model_len // config.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"{field}: the KV budget of {budget / 2**20:.1f} MiB holds {num_blocks * config.block_size} tokens "
                f"of {config.kv_cache_dtype} KV ({self.kv_bytes_per_token} bytes/token), less than one request at "
                f"max context ({self.max_model_len} tokens, {needed * block_bytes / 2**20:.1f} MiB); raise {field} "
                f"or lower max_model_len to at most {num_blocks * config.block_size}")
        return num_blocks

    def _profile_cuda_budget(self) -> int:
        """total x utilisation - (weights + activations at the largest step) - memory of other processes."""
        config = self.config
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.runner.dummy_forward(min(config.max_num_batched_tokens, self.max_model_len), config.max_num_seqs)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        others = total - free - torch.cuda.memory_reserved(self.device)
        budget = int(total * config.gpu_memory_utilization - peak - others)
        log.info("CUDA memory: total %.1f GiB, peak of weights + largest step %.2f GiB, other processes %.2f GiB, "
                 "KV budget %.2f GiB at utilisation %.2f", total / 2**30, peak / 2**30, others / 2**30,
                 budget / 2**30, config.gpu_memory_utilization)
        return max(budget, 0)

    def _compute_dtype(self) -> torch.dtype:
        if self.config.dtype != "auto":
            if self.config.dtype not in _DTYPES:
                raise ValueError(f"dtype: unknown value {self.config.dtype!r}; allowed: auto, {', '.join(_DTYPES)}")
            return _DTYPES[self.config.dtype]
        if self.device.type == "cpu":
            return torch.float32   # 16-bit matrix products are 20-250x slower on CPUs without bf16 units
        model_dtype = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
        return model_dtype if model_dtype in (torch.float16, torch.bfloat16) else torch.float16

    def _max_model_len(self) -> int:
        limit = getattr(self.hf_config, "max_position_embeddings", 4096)
        window = getattr(self.hf_config, "sliding_window", None)
        if window and getattr(self.hf_config, "use_sliding_window", True):
            limit = min(limit, window)   # full attention matches sliding-window attention only up to the window
        if self.config.max_model_len and self.config.max_model_len > limit:
            raise ValueError(f"max_model_len: {self.config.max_model_len} exceeds the model's context of {limit}")
        return self.config.max_model_len or limit

    def _eos_token_ids(self) -> set[int]:
        ids = getattr(self.hf_config, "eos_token_id", None)
        ids = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    lane: str = "batch", priority: int = 0, order_key: tuple = ()) -> Request:
        """Queue a request. One that cannot run is finished at once with finish_reason 'error'."""
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in the engine")
        request = Request(request_id, list(prompt_token_ids), params, lane, priority, order_key)
        self.requests[request_id] = request
        error = self._check_request(request)
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
        if any(not 0 <= t < vocab for t in request.prompt_token_ids):
            return f"prompt: token ids must be in [0, {vocab})"
        if n >= self.max_model_len:
            return f"prompt: {n} tokens does not fit the context of {self.max_model_len} tokens (max_model_len)"
        return None   # the pool holds one request at max context (checked at start-up): it always fits alone

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._rejected)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; returns its final output (None if unknown or finished)."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return None
        self._finish(request, "abort")
        return self._output(request)

    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output for each request that got a token or finished."""
        start = time.perf_counter()
        touched = self._rejected
        self._rejected = []
        plan = self.scheduler.schedule()
        if plan.scheduled:
            logits, sample_reqs = self.runner.run(plan)
            for request, n in plan.scheduled:
                if request.num_computed_tokens < request.num_prompt_tokens:
                    self.stats.prompt_tokens += min(n, request.num_prompt_tokens - request.num_computed_tokens)
                request.num_computed_tokens += n
                self.block_manager.cache_full_blocks(request)
            tokens, logprobs = self.sampler(logits, sample_reqs)
            for request, token, logprob in zip(sample_reqs, tokens, logprobs):
                self._append_token(request, token, logprob)
                touched.append(request)
            self.stats.output_tokens += len(sample_reqs)
        elif not touched and self.scheduler.running:
            raise RuntimeError("scheduler planned no work while requests are running")
        self._update_stats(plan.num_tokens, time.perf_counter() - start)
        return [self._output(r) for r in touched]

    def _append_token(self, request: Request, token: int, logprob: float | None) -> None:
        request.token_ids.append(token)
        if logprob is not None:
            request.logprobs.append(logprob)
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        params = request.params
        num_output = request.num_tokens - request.num_prompt_tokens
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            self._finish(request, "stop")
        elif params.stop and self._cut_at_stop_string(request):
            self._finish(request, "stop")
        elif num_output >= params.max_tokens or request.num_tokens >= self.max_model_len:
            self._finish(request, "length")

    def _cut_at_stop_string(self, request: Request) -> bool:
        if self.tokenizer is None:
            return False
        text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in request.params.stop) if i >= 0]
        if hits:
            request.text = text[:min(hits)]
        return bool(hits)

    def _finish(self, request: Request, reason: str, error: str | None = None) -> None:
        if request.status is not RequestStatus.FINISHED:
            self.scheduler.finish(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason, request.error = reason, error
        request.finish_time = time.monotonic()
        if request.text is None and self.tokenizer is not None and reason != "error":
            request.text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)

    def _output(self, request: Request) -> RequestOutput:
        done = request.finished
        if done:
            self.requests.pop(request.request_id, None)
        return RequestOutput(
            request_id=request.request_id, prompt_tokens=request.num_prompt_tokens,
            token_ids=request.output_token_ids, text=request.text if done else None, finished=done,
            finish_reason=request.finish_reason, error=request.error,
            logprobs=list(request.logprobs) if request.params.logprobs else None,
            cached_tokens=request.num_cached_tokens,
            time_to_first_token=(request.first_token_time - request.arrival_time) if request.first_token_time else None,
            latency=(request.finish_time - request.arrival_time) if done else None)

    def _update_stats(self, scheduled_tokens: int, step_time: float) -> None:
        s = self.stats
        s.step += 1
        s.running, s.waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        s.scheduled_tokens, s.step_time = scheduled_tokens, step_time
        s.kv_blocks_free = self.block_manager.num_free_blocks
        s.kv_blocks_used = self.num_blocks - s.kv_blocks_free
        s.prefix_cache_hit_tokens = self.block_manager.prefix_hits
        s.preemptions = self.scheduler.num_preemptions
