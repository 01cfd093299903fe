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
    output: RequestOutput          # cumulative state of its sample (text set once finished)
    last: bool = False             # the request's last chunk: every sample finished

    @property
    def finished(self) -> bool:
        """This chunk's sample finished."""
        return self.output.finished


class _Decoder:
    """Text deltas of one sample's growing output, decoding a short window rather than the whole output
    (quadratic in long streams)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.sent_tokens = 0
        self.sent_text = ""
        self._prefix_offset = self._read_offset = 0   # the window of output tokens decoded for the next delta

    def push(self, output: RequestOutput) -> tuple[list[int], str]:
        new_ids = output.token_ids[self.sent_tokens:]
        self.sent_tokens = len(output.token_ids)
        if output.finished or self._tokenizer is None:
            text = output.text or ""
        else:
            text = self.sent_text + self._delta(output.token_ids)
        new_text, self.sent_text = text[len(self.sent_text):], text
        return new_ids, new_text

    def _delta(self, ids: list[int]) -> str:
        """The window starts a few tokens back so that both decodes see the same first token (whose leading
        space a tokenizer may drop); an incomplete multi-byte character waits for its last byte."""
        prefix = self._tokenizer.decode(ids[self._prefix_offset:self._read_offset], skip_special_tokens=True)
        text = self._tokenizer.decode(ids[self._prefix_offset:], skip_special_tokens=True)
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return text[len(prefix):]


class RequestHandle:
    """Filled by the stepping thread through `_push`; read from any thread (or event loop). With n samples, the
    chunks of all samples come through one stream (each chunk's output says which sample)."""

    def __init__(self, request_id: str, tokenizer, cancel):
        self.request_id = request_id
        self._tokenizer = tokenizer
        self._cancel = cancel
        self._chunks: queue.Queue[StreamChunk] = queue.Queue()
        self._done = threading.Event()
        self._waker: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None   # an astream() waiting
        self._decoders: dict[int, _Decoder] = {}
        self._finals: list[RequestOutput] = []

    def _push(self, output: RequestOutput) -> None:
        decoder = self._decoders.setdefault(output.sample_index, _Decoder(self._tokenizer))
        new_ids, new_text = decoder.push(output)
        last = output.prompt_outputs is not None   # the request's last sample finished
        self._chunks.put(StreamChunk(new_ids, new_text, output, last))
        if last:
            self._finals = output.prompt_outputs
            self._done.set()
        waker = self._waker
        if waker is not None:
            loop, ready = waker
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:   # its event loop has closed: nobody is waiting any more
                self._waker = None

    def stream(self, timeout: float | None = None):
        """Yield StreamChunks until the request finishes."""
        while True:
            chunk = self._chunks.get(timeout=timeout)
            yield chunk
            if chunk.last:
                return

    async def astream(self):
        """The same for asyncio callers, without blocking the event loop: woken by the stepping thread when a chunk
        arrives (polling every request's queue on a timer costs the engine's thread the GIL many times a step)."""
        ready = asyncio.Event()
        self._waker = (asyncio.get_running_loop(), ready)
        try:
            while True:
                try:
                    chunk = self._chunks.get_nowait()
                except queue.Empty:
                    await ready.wait()
                    ready.clear()
                    continue
                yield chunk
                if chunk.last:
                    return
        finally:
            self._waker = None

    def result(self, timeout: float | None = None) -> RequestOutput:
        """The final output (of sample 0 when there are n)."""
        return self.results(timeout)[0]

    def results(self, timeout: float | None = None) -> list[RequestOutput]:
        """The final output of each sample, by sample_index."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not finished after {timeout}s")
        return list(self._finals)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Abort the request; its KV blocks are freed at the next step."""
        if not self.done:
            self._cancel(self.request_id)
