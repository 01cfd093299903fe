"""Response bodies in the OpenAI shapes: text_completion and chat.completion(.chunk), usage, logprobs, SSE."""
from __future__ import annotations

import json
import time

from batchrun.engine.request import RequestOutput


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(outs: list[RequestOutput]) -> dict:
    """One request's usage: its prompt once, the completion tokens of all its samples."""
    completion = sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": outs[0].prompt_tokens, "completion_tokens": completion,
            "total_tokens": outs[0].prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": outs[0].cached_tokens}}


def hold_back_stop_prefix(text: str, stops: list[str]) -> str:
    """The part of streamed text that is safe to send: cut the longest tail that could begin a stop string,
    so a stop string is never half-sent before the engine cuts the output there."""
    keep = len(text)
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                keep = min(keep, len(text) - n)
                break
    return text[:keep]


class Format:
    """One of the two endpoints' body shapes."""
    prefix = object_full = object_chunk = ""

    def __init__(self, request_id: str, model: str, tokenizer):
        self.id, self.model, self.tokenizer = request_id, model, tokenizer
        self.created = int(time.time())

    def _body(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def full(self, outs: list[RequestOutput], with_logprobs: bool) -> dict:
        """The body for a request's final outputs: a choice per sample."""
        choices = [self.choice_full(out.text or "", out.finish_reason,
                                    self.logprobs(out.token_ids, out.logprobs or [], 0) if with_logprobs else None,
                                    out.sample_index) for out in outs]
        return self._body(self.object_full, choices, usage=usage(outs))

    def chunk(self, text: str, finish_reason: str | None, lp=None) -> dict:
        return self._body(self.object_chunk, [self.choice_delta(text, finish_reason, lp)])

    def usage_chunk(self, out: RequestOutput) -> dict:
        return self._body(self.object_chunk, [], usage=usage([out]))

    def _token_texts(self, token_ids: list[int]) -> list[str]:
        if self.tokenizer is None:
            return [str(t) for t in token_ids]
        return [self.tokenizer.decode([t]) for t in token_ids]


class CompletionFormat(Format):
    object_full = object_chunk = "text_completion"

    def choice_full(self, text, finish_reason, lp, index: int = 0):
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}

    choice_delta = choice_full

    def logprobs(self, token_ids, logprobs, offset: int) -> dict:
        tokens = self._token_texts(token_ids)
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": offsets}


class ChatFormat(Format):
    object_full, object_chunk = "chat.completion", "chat.completion.chunk"

    def choice_full(self, text, finish_reason, lp, index: int = 0):
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                "finish_reason": finish_reason}

    def choice_delta(self, text, finish_reason, lp):
        return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": lp, "finish_reason": finish_reason}

    def role_chunk(self) -> dict:
        return self._body(self.object_chunk, [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}])

    def logprobs(self, token_ids, logprobs, offset: int = 0) -> dict:
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                            for t, lp in zip(self._token_texts(token_ids), logprobs)]}
