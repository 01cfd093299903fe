"""The Python API, in the shape vLLM users know: LLM(...).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

import time
from typing import Any, Sequence

from tqdm.auto import tqdm

from batchrun.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.engine.request import Request, RequestOutput
from batchrun.sampling_params import SamplingParams

Prompt = str | list[int] | list[dict]


def _is_single_prompt(prompts: Any) -> bool:
    if isinstance(prompts, str):
        return True
    return isinstance(prompts, list) and bool(prompts) and all(isinstance(p, (int, dict)) for p in prompts)


class LLM:
    def __init__(self, model: str = "smollm2-135m", **engine_options):
        unknown = set(engine_options) - set(EngineConfig.field_names())
        if unknown:
            raise TypeError(f"LLM: unknown option(s) {', '.join(sorted(unknown))}; "
                            f"allowed: {', '.join(EngineConfig.field_names())}")
        admission_key = engine_options.pop("admission_key", None)
        self.engine = Engine(EngineConfig(model=model, **engine_options),
                             **({"admission_key": admission_key} if admission_key else {}))

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
        return self.engine.add_request(self.encode(prompt), params or SamplingParams(), **kwargs)

    def step(self) -> list[RequestOutput]:
        return self.engine.step()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lane: str = "batch", priority: int = 0) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        if _is_single_prompt(prompts):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        ids = []
        for prompt, p in zip(prompts, params):
            ids.append(self.engine.add_request(self.encode(prompt), p, lane=lane, priority=priority).request_id)
        results = self._run_until_done(set(ids), use_tqdm)
        return [results[i] for i in ids]

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, **kwargs) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; each goes through the chat template."""
        return self.generate(messages, sampling_params, **kwargs)

    def _run_until_done(self, pending: set[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(pending), desc="generate", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        out_tokens, start = 0, time.perf_counter()
        with bar:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        results[out.request_id] = out
                        out_tokens += len(out.token_ids)
                        bar.update(1)
                s = self.engine.stats
                elapsed = max(time.perf_counter() - start, 1e-9)
                bar.set_postfix_str(f"out {out_tokens / elapsed:.1f} tok/s, run {s.running}, wait {s.waiting}, "
                                    f"kv {s.kv_blocks_used}/{self.engine.num_blocks}, preempt {s.preemptions}",
                                    refresh=False)
        return results
