"""Per-request sampling settings, validated on construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from batchrun import structured

INT64_MAX = 2**63 - 1
SEED_MIN, SEED_MAX = -2**63, 2**64 - 1     # what torch.Generator.manual_seed accepts
MAX_N = 1024


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: off
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False              # return the log-probability of each chosen token
    # return the log-probability of each prompt token given those before it (none for the first): the prompt's
    # teacher-forced likelihood. Such a prompt is computed in full, never served from the prefix cache.
    prompt_logprobs: bool = False
    n: int = 1                          # samples per prompt; the prompt is prefilled once and its blocks shared
    # Structured outputs (one at most): the output must match it; a complete match ends the request ("stop").
    json_schema: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None          # EBNF (xgrammar's dialect, GBNF-like)
    json_object: bool = False           # any JSON object (OpenAI's response_format json_object)
    adapter: str | None = None          # the LoRA adapter (a name the engine was given) to run under; None: base

    def __post_init__(self):
        """Every value is checked here, once, whichever door it came through (Python, a job file, a row column, an
        OpenAI batch body, a server body): a value that passes cannot fail inside the engine's shared step."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _list_of(self.stop, "stop", str, "strings")
        self.stop = [s for s in self.stop if s]
        self.stop_token_ids = _list_of(self.stop_token_ids, "stop_token_ids", int, "integers")
        if any(not 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids: token ids must be in [0, {INT64_MAX}], got {_show(self.stop_token_ids)}")
        _integer(self.max_tokens, "max_tokens", 1, INT64_MAX, "a positive integer")
        _number(self.temperature, "temperature", lambda t: t >= 0, "a finite number >= 0 (0 means greedy)")
        _number(self.top_p, "top_p", lambda p: 0 < p <= 1, "a number in (0, 1]")
        _integer(self.top_k, "top_k", -1, INT64_MAX, "-1, 0 (off) or a positive integer")
        _integer(self.n, "n", 1, MAX_N, f"a positive integer (at most {MAX_N})")
        if self.seed is not None:
            _integer(self.seed, "seed", SEED_MIN, SEED_MAX, f"an integer in [{SEED_MIN}, {SEED_MAX}]")
        for name in ("ignore_eos", "logprobs", "prompt_logprobs", "json_object"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be true or false, got {_show(getattr(self, name))}")
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise ValueError(f"adapter: must be an adapter name (a non-empty string) or null, got {_show(self.adapter)}")
        structured.check(self)

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, source) of the structured-output constraint, None when the output is free."""
        return structured.constraint(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _show(value) -> str:
    """A value as a message shows it: its repr, cut short, and never a Python type's repr."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _integer(value, name: str, low: int, high: int, what: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{name}: must be {what}, got {_show(value)}")


def _number(value, name: str, ok, what: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name}: must be {what}, got {_show(value)}")


def _list_of(value, name: str, kind: type, what: str) -> list:
    """value as a list whose every item is a `kind` (bools are not integers here)."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name}: must be a list of {what}, got {_show(value)}")
    for i, item in enumerate(value):
        if not isinstance(item, kind) or isinstance(item, bool):
            raise ValueError(f"{name}: must be a list of {what}; item {i} is {_show(item)}")
    return list(value)


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a prompt: seed + index, wrapped into the generator's range."""
    seed += index
    return seed - 2**64 if seed > SEED_MAX else seed
