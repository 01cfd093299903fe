"""Requests submitted from other threads (an HTTP server, a notebook): an inbox drained by whoever steps the
engine, and a handle per request to stream its tokens or wait for its result."""
from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass

from batchrun.engine.request import RequestOutput


class EngineOverloaded(RuntimeError):
    """Too many interactive requests waiting; callers should retry later (HTTP 429)."""


@dataclass
class StreamChunk:
    new_token_ids: list[int]
    new_text: str
    output: RequestOutput          # cumulative state (text set once finished)

    @property
    def finished(self) -> bool:
        return self.output.finished


class RequestHandle:
    """Filled by the stepping thread through `_push`; read from any thread (or event loop)."""

    def __init__(self, request_id: str, tokenizer, cancel):
        self.request_id = request_id
        self._tokenizer = tokenizer
        self._cancel = cancel
        self._chunks: queue.Queue[StreamChunk] = queue.Queue()
        self._done = threading.Event()
        self._result: RequestOutput | None = None
        self._sent_tokens = 0
        self._sent_text = ""
        self._prefix_offset = self._read_offset = 0   # the window of output tokens decoded for the next delta

    def _push(self, output: RequestOutput) -> None:
        new_ids = output.token_ids[self._sent_tokens:]
        self._sent_tokens = len(output.token_ids)
        text = self._decode(output)
        new_text, self._sent_text = text[len(self._sent_text):], text
        self._chunks.put(StreamChunk(new_ids, new_text, output))
        if output.finished:
            self._result = output
            self._done.set()

    def _decode(self, output: RequestOutput) -> str:
        if output.finished or self._tokenizer is None:
            return output.text or ""
        return self._sent_text + self._delta(output.token_ids)

    def _delta(self, ids: list[int]) -> str:
        """Text added by the newest tokens, decoding a short window rather than the whole output (quadratic in
        long streams). The window starts a few tokens back so that both decodes see the same first token (whose
        leading space a tokenizer may drop); an incomplete multi-byte character waits for its last byte."""
        prefix = self._tokenizer.decode(ids[self._prefix_offset:self._read_offset], skip_special_tokens=True)
        text = self._tokenizer.decode(ids[self._prefix_offset:], skip_special_tokens=True)
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return text[len(prefix):]

    def stream(self, timeout: float | None = None):
        """Yield StreamChunks until the request finishes."""
        while True:
            chunk = self._chunks.get(timeout=timeout)
            yield chunk
            if chunk.finished:
                return

    async def astream(self, poll: float = 0.01):
        """The same for asyncio callers, without blocking the event loop."""
        while True:
            try:
                chunk = self._chunks.get_nowait()
            except queue.Empty:
                await asyncio.sleep(poll)
                continue
            yield chunk
            if chunk.finished:
                return

    def result(self, timeout: float | None = None) -> RequestOutput:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not finished after {timeout}s")
        return self._result

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Abort the request; its KV blocks are freed at the next step."""
        if not self.done:
            self._cancel(self.request_id)
