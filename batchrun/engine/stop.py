"""When a request is done: the rules checked after each sampled token, in the engine and in simulations alike."""
from __future__ import annotations

from dataclasses import dataclass

from batchrun.engine.request import Request


@dataclass(frozen=True)
class StopRule:
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int | None = None
    tokenizer: object = None      # needed only for stop strings

    def __call__(self, request: Request) -> str | None:
        """'stop' or 'length' when the request's last token ends it, else None. A stop string cuts request.text."""
        token, params = request.token_ids[-1], request.params
        if request.grammar is not None and request.grammar.is_terminated():
            return "stop"
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop"
        if params.stop and self._cut_at_stop_string(request):
            return "stop"
        if (request.num_tokens - request.num_prompt_tokens >= params.max_tokens
                or (self.max_model_len is not None and request.num_tokens >= self.max_model_len)):
            return "length"
        return None

    def _cut_at_stop_string(self, request: Request) -> bool:
        """Decodes only the newest tokens each step (linear in the output's length); the whole output once, on a
        hit, to cut the text at the first stop string."""
        if self.tokenizer is None:
            return False
        stops = request.params.stop
        window = 4 * max(map(len, stops)) + 4   # a byte-level token may carry a quarter of a character
        start = max(request.num_prompt_tokens, request.num_tokens - window)
        tail = self.tokenizer.decode(request.token_ids[start:], skip_special_tokens=True)
        if not any(s in tail for s in stops):
            return False
        text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            request.text = text[:min(hits)]
        return bool(hits)
