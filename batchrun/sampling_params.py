"""Per-request sampling settings, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchrun import structured


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
    n: int = 1                          # samples per prompt; the prompt is prefilled once and its blocks shared
    # Structured outputs (one at most): the output must match it; a complete match ends the request ("stop").
    json_schema: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None          # EBNF (xgrammar's dialect, GBNF-like)
    json_object: bool = False           # any JSON object (OpenAI's response_format json_object)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens: must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0 (0 means greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k: must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed: must be an integer, got {self.seed!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n: must be a positive integer, got {self.n!r}")
        structured.check(self)

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, source) of the structured-output constraint, None when the output is free."""
        return structured.constraint(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
