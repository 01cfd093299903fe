"""Request bodies of /v1/completions and /v1/chat/completions, and their translation to batchrun terms.

Fields batchrun cannot honour (n > 1 with streaming, echo, suffix, penalties, logit_bias, tools) are refused with a
400 naming the field rather than silently ignored; unknown fields are ignored, as OpenAI clients send extras.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt

from batchrun import structured
from batchrun.sampling_params import SamplingParams
from batchrun.server.errors import bad_request, from_value_error

ROLES = {"system", "user", "assistant", "developer"}


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: StrictInt | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM-style extensions (the openai client sends them through extra_body)
    top_k: StrictInt | None = None
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[StrictInt] | None = None
    response_format: dict | None = None   # OpenAI's on chat; accepted on completions too, as vLLM does

    def check_supported(self) -> None:
        if self.stream and self.n not in (None, 1):
            raise bad_request(f"n: n > 1 is supported without streaming only, got n={self.n} with stream=true", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise bad_request(f"{name}: not supported by batchrun (use 0 or leave it out)", name)
        if self.logit_bias:
            raise bad_request("logit_bias: not supported by batchrun", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options: only allowed with stream=true", "stream_options")

    def sampling_params(self, max_tokens: int, logprobs: bool) -> SamplingParams:
        try:
            constraint = structured.from_response_format(self.response_format)
        except ValueError as exc:
            raise from_value_error(exc) from exc
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, seed=self.seed,
                stop=self.stop, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=bool(self.ignore_eos),
                logprobs=logprobs, n=1 if self.n is None else self.n, **constraint)
        except ValueError as exc:
            if constraint and str(exc).split(":", 1)[0] in structured.KINDS:   # the schema inside response_format
                raise bad_request(f"response_format: {exc}", "response_format") from exc
            raise from_value_error(exc) from exc

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: Any
    max_tokens: StrictInt | None = None          # None: 16, as OpenAI (clipped to the context)
    logprobs: StrictInt | None = None
    echo: StrictBool | None = False
    suffix: str | None = None
    best_of: StrictInt | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise bad_request("echo: not supported by batchrun", "echo")
        if self.suffix:
            raise bad_request("suffix: not supported by batchrun", "suffix")
        if self.best_of not in (None, 1):
            raise bad_request(f"best_of: only best_of=1 is supported, got {self.best_of}", "best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= 1:
            raise bad_request(f"logprobs: batchrun returns the chosen token's log-probability only; "
                              f"use 0 or 1, got {self.logprobs}", "logprobs")

    def engine_prompt(self) -> str | list[int]:
        """A string or a token-id list; a batch of one is unwrapped, larger batches are refused."""
        prompt = self.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("prompt: must not be empty", "prompt")
            return prompt
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise bad_request(f"prompt: one prompt per request is supported, got a batch of {len(prompt)}", "prompt")
        raise bad_request("prompt: expected a non-empty string or a non-empty list of token ids", "prompt")


class ChatCompletionRequest(_Common):
    messages: Any
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    tools: list | None = None
    tool_choice: Any = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs:
            raise bad_request("top_logprobs: not supported; batchrun returns the chosen token's log-probability "
                              "only (logprobs: true)", "top_logprobs")
        if self.tools:
            raise bad_request("tools: tool calling is not supported by batchrun", "tools")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def engine_messages(self) -> list[dict]:
        """Messages as {role, content} dicts for the chat template; text content parts are joined."""
        if not isinstance(self.messages, list) or not self.messages:
            raise bad_request("messages: expected a non-empty list of messages", "messages")
        out = []
        for i, m in enumerate(self.messages):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise bad_request(f"{where}: expected an object with role and content", where)
            role = m.get("role")
            if role not in ROLES:
                raise bad_request(f"{where}.role: expected one of {', '.join(sorted(ROLES))}, got {role!r}",
                                  f"{where}.role")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _content_text(m.get("content"), f"{where}.content")})
        return out


def _content_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}[{j}]: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                                  f"{where}[{j}]")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"{where}: expected a string or a list of text parts, got {type(content).__name__}", where)
