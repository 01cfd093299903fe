"""A generation request and the output handed back to callers."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from batchrun.sampling_params import SamplingParams

_arrival_counter = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lane: str = "batch"
    priority: int = 0                     # higher is admitted first
    order_key: tuple = ()                 # admission order within a priority (e.g. a length bucket)
    arrival_index: int = field(default_factory=lambda: next(_arrival_counter))
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0          # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hash of each full block of token_ids
    num_cached_tokens: int = 0            # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None      # "stop", "length" or "error"
    error: str | None = None
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)   # of prompt tokens 1, 2, ... as computed so far
    first_token_time: float | None = None
    finish_time: float | None = None
    generator: object = None              # torch.Generator for seeded sampling
    text: str | None = None               # detokenized output, set on finish (or cut at a stop string)
    sample_index: int = 0                 # which of the prompt's params.n samples
    grammar: object = None                # structured output: the xgrammar matcher of this sample

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def adapter(self) -> str | None:
        return self.params.adapter

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def forks_pending(self) -> bool:
        """A prompt with n > 1 samples, before its first token: its siblings are forked from it then."""
        return self.params.n > 1 and self.sample_index == 0 and self.num_tokens == self.num_prompt_tokens

    @property
    def num_samples(self) -> int:
        """How many final outputs its request id ends with: params.n, or 1 when it ended before its first token
        (rejected or aborted: its other samples never started)."""
        return 1 if self.finished and self.forks_pending else self.params.n


@dataclass
class RequestOutput:
    request_id: str
    prompt_tokens: int
    token_ids: list[int]
    text: str | None
    finished: bool
    finish_reason: str | None
    error: str | None = None
    logprobs: list[float] | None = None
    prompt_logprobs: list[float | None] | None = None   # [None, logprob of prompt token 1 given token 0, ...]
    cached_tokens: int = 0
    time_to_first_token: float | None = None   # seconds from arrival
    latency: float | None = None               # seconds from arrival to finish
    sample_index: int = 0                      # with n > 1 samples per prompt: which one (same request_id)
    num_samples: int = 1                       # final outputs its request_id ends with (Request.num_samples)
    # On the output that finishes its prompt (the last of its samples to finish): every sample's final output, by
    # sample_index (itself among them). None on the others.
    prompt_outputs: list["RequestOutput"] | None = field(default=None, repr=False)

    @classmethod
    def failed(cls, request_id: str, prompt_tokens: int, error: str) -> "RequestOutput":
        """The final output of a request that ended before the engine ran it (its prompt's only output)."""
        out = cls(request_id, prompt_tokens, [], "", True, "error", error=error)
        out.prompt_outputs = [out]
        return out

    @classmethod
    def of(cls, request: Request) -> "RequestOutput":
        """The request's own output now (prompt_outputs left to the engine)."""
        done = request.finished
        return cls(
            request_id=request.request_id, prompt_tokens=request.num_prompt_tokens,
            token_ids=request.output_token_ids, text=request.text if done else None, finished=done,
            finish_reason=request.finish_reason, error=request.error,
            logprobs=list(request.logprobs) if request.params.logprobs else None,
            prompt_logprobs=[None, *request.prompt_logprobs] if request.params.prompt_logprobs else None,
            cached_tokens=request.num_cached_tokens,
            time_to_first_token=(request.first_token_time - request.arrival_time) if request.first_token_time else None,
            latency=(request.finish_time - request.arrival_time) if done else None, sample_index=request.sample_index,
            num_samples=request.num_samples)
