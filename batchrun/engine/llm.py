"""The Python API, in the shape vLLM users know: LLM(...).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from batchrun.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.engine.handles import EngineOverloaded, RequestHandle
from batchrun.engine.openmp_pool import release_thread_pool
from batchrun.engine.request import Request, RequestOutput
from batchrun.engine.step_threads import StepThreads
from batchrun.sampling_params import SamplingParams

Prompt = str | list[int] | list[dict]
log = logging.getLogger("batchrun")


def _is_single_prompt(prompts: Any) -> bool:
    if isinstance(prompts, str):
        return True
    return isinstance(prompts, list) and bool(prompts) and all(isinstance(p, (int, dict)) for p in prompts)


class LLM:
    def __init__(self, model: str = "smollm2-135m", **engine_options):
        admission_key = engine_options.pop("admission_key", None)
        unknown = set(engine_options) - set(EngineConfig.field_names())
        if unknown:
            raise TypeError(f"LLM: unknown option(s) {', '.join(sorted(unknown))}; "
                            f"allowed: {', '.join(EngineConfig.field_names())}")
        self.engine = Engine(EngineConfig(model=model, **engine_options),
                             **({"admission_key": admission_key} if admission_key else {}))
        self.max_pending_submits = 256
        self._inbox: list[tuple] = []
        self._aborts: list[str] = []
        self._handles: dict[str, RequestHandle] = {}
        self._inbox_lock = threading.Lock()
        self._submit_ids = itertools.count()
        self._wake = threading.Event()
        self._stop_loop = threading.Event()
        self._loop_thread: threading.Thread | None = None
        self.loop_error: str | None = None   # why the background loop stopped stepping, if a step failed

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model(self):
        return self.engine.model

    @property
    def model_path(self) -> str:
        return self.engine.model_path

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a string, a token-id list, or a chat message list (through the chat template)."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; pass token-id lists")
        if isinstance(prompt, str):
            return self.tokenizer(prompt).input_ids
        if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
            return list(self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False))
        raise ValueError(f"prompt: expected a string, a list of token ids or a list of chat messages, "
                         f"got {type(prompt).__name__}")

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, **kwargs) -> Request:
        """Queue a request from the thread that steps the engine (see `submit` for other threads)."""
        return self.engine.add_request(self.encode(prompt), params or SamplingParams(), **kwargs)

    def submit(self, prompt: Prompt, params: SamplingParams | None = None, lane: str = "interactive",
               request_id: str | None = None, priority: int = 0) -> RequestHandle:
        """Thread-safe: queue a request and return a handle to stream its tokens or wait for its result.

        The request joins at the next `step()` of whoever drives the engine (a job, `generate`, or the background
        loop started by `start_background()`). Raises EngineOverloaded when too many are already waiting.
        """
        if self.loop_error:
            raise RuntimeError(f"engine failed: {self.loop_error}")
        token_ids = self.encode(prompt)
        with self._inbox_lock:
            if len(self._handles) >= self.max_pending_submits:
                raise EngineOverloaded(f"{len(self._handles)} submitted requests in flight "
                                       f"(limit {self.max_pending_submits}); retry later")
            request_id = request_id or f"submit-{next(self._submit_ids)}"
            if request_id in self._handles:
                raise ValueError(f"request_id: {request_id!r} is already in flight")
            params = params or SamplingParams()
            handle = RequestHandle(request_id, self.tokenizer, self._inbox_abort)
            self._handles[request_id] = handle
            self._inbox.append((token_ids, params, request_id, lane, priority))
        self._wake.set()
        return handle

    def _inbox_abort(self, request_id: str) -> None:
        with self._inbox_lock:
            self._aborts.append(request_id)
        self._wake.set()

    def step(self) -> list[RequestOutput]:
        """One engine step. Outputs of submitted requests go to their handles; the rest are returned."""
        with self._inbox_lock:
            inbox, aborts = self._inbox, self._aborts
            self._inbox, self._aborts = [], []
        for token_ids, params, request_id, lane, priority in inbox:
            try:
                self.engine.add_request(token_ids, params, request_id=request_id, lane=lane, priority=priority)
            except ValueError as exc:   # this request alone (e.g. its id is taken by a request of a job)
                with self._inbox_lock:
                    handle = self._handles.pop(request_id)
                handle._push(RequestOutput.failed(request_id, len(token_ids), str(exc)))
        for request_id in aborts:
            finals = self.engine.abort(request_id)
            handle = self._handles.pop(request_id, None)
            for final in finals if handle is not None else ():
                handle._push(final)
        outputs = []
        for out in self.engine.step():
            handle = self._handles.get(out.request_id)
            if handle is None:
                outputs.append(out)
                continue
            handle._push(out)
            if handle.done:
                with self._inbox_lock:
                    self._handles.pop(out.request_id, None)
        return outputs

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished() or bool(self._inbox) or bool(self._aborts)

    def reset_prefix_cache(self) -> int:
        """Forget the cached prompt blocks no request holds (vLLM's LLM.reset_prefix_cache); returns how many. Call
        it between generate() calls, not while the background loop steps the engine."""
        if self._loop_thread is not None and self._loop_thread.is_alive():
            raise RuntimeError("reset_prefix_cache: the background loop is stepping the engine; stop_background() "
                               "first")
        return self.engine.reset_prefix_cache()

    def start_background(self) -> None:
        """Step the engine in a daemon thread whenever there is work (for serving without a job); on the CPU, small
        steps run on one thread there (step_threads.py), and the calling thread's OpenMP workers are released
        (openmp_pool.py)."""
        if self._loop_thread is None or not self._loop_thread.is_alive():
            if self.engine.device.type == "cpu" and torch.get_num_threads() > 1:
                self.engine.step_threads = StepThreads()
                release_thread_pool()
            self._stop_loop.clear()
            self._loop_thread = threading.Thread(target=self._background_loop, name="batchrun-engine", daemon=True)
            self._loop_thread.start()

    def stop_background(self) -> None:
        self._stop_loop.set()
        self._wake.set()
        if self._loop_thread is not None:
            self._loop_thread.join()
        if self.engine.step_threads is not None:
            self.engine.step_threads.restore()
            self.engine.step_threads = None

    def close(self) -> None:
        """Stop the background loop and the engine's tensor-parallel worker ranks; the LLM cannot step after."""
        self.stop_background()
        self.engine.close()

    @property
    def healthy(self) -> bool:
        """False once a step of the background loop has failed (the loop has stopped)."""
        return self.loop_error is None

    def _background_loop(self) -> None:
        try:
            if self.engine.step_threads is not None:
                self.engine.step_threads.warm_up(self.engine)
            while not self._stop_loop.is_set():
                if self.has_unfinished():
                    self.step()
                else:
                    self._wake.wait(0.5)
                    self._wake.clear()
        except Exception as exc:   # callers waiting on handles must hear of it, not wait forever
            log.exception("engine step failed; the background loop has stopped")
            self.loop_error = f"{type(exc).__name__}: {exc}"
            self._fail_submitted(f"engine failed: {self.loop_error}")

    def _fail_submitted(self, message: str) -> None:
        with self._inbox_lock:
            handles, self._handles, self._inbox = self._handles, {}, []
        for request_id, handle in handles.items():
            handle._push(RequestOutput.failed(request_id, 0, message))

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lane: str = "batch", priority: int = 0,
                 adapter: str | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order (with n > 1 samples per prompt, its n
        outputs one after the other, by sample_index). `adapter`: run every prompt under that LoRA adapter (else
        each SamplingParams' own `adapter`)."""
        if _is_single_prompt(prompts):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        if adapter is not None:
            params = [dataclasses.replace(p, adapter=adapter) for p in params]
        ids = []
        for prompt, p in zip(prompts, params):
            ids.append(self.engine.add_request(self.encode(prompt), p, lane=lane, priority=priority).request_id)
        try:
            results = self._run_until_done(ids, sum(p.n for p in params), use_tqdm)
        except KeyboardInterrupt:   # Ctrl-C (a kernel interrupt): free this call's requests, keep the engine usable
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        return [out for i in ids for out in results[i]]

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, **kwargs) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; each goes through the chat template."""
        return self.generate(messages, sampling_params, **kwargs)

    def _run_until_done(self, ids: list[str], expected: int, use_tqdm: bool) -> dict[str, list[RequestOutput]]:
        """Step until each request id has its samples' final outputs (`expected` of them at most, for the bar)."""
        results: dict[str, list[RequestOutput]] = {}
        pending = set(ids)
        bar = tqdm(total=expected, desc="generate", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        out_tokens, start = 0, time.perf_counter()
        with bar:
            while pending:
                for out in self.step():
                    if out.finished and out.request_id in pending:
                        out_tokens += len(out.token_ids)
                        bar.update(1)
                    if out.prompt_outputs is not None and out.request_id in pending:
                        results[out.request_id] = out.prompt_outputs
                        pending.discard(out.request_id)
                s = self.engine.stats
                elapsed = max(time.perf_counter() - start, 1e-9)
                bar.set_postfix_str(f"out {out_tokens / elapsed:.1f} tok/s, run {s.running}, wait {s.waiting}, "
                                    f"kv {s.kv_blocks_used}/{self.engine.num_blocks}, preempt {s.preemptions}",
                                    refresh=False)
        return results
