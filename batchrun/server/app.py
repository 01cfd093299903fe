"""The OpenAI-compatible HTTP front of an LLM: requests go to the engine's interactive lane through
`llm.submit`; whoever steps the engine (a job, or `llm.start_background()`) makes them progress."""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import time
import uuid
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from batchrun.engine.handles import EngineOverloaded, RequestHandle
from batchrun.server.errors import APIError, bad_request, from_value_error
from batchrun.server.formats import SSE_DONE, ChatFormat, CompletionFormat, Format, hold_back_stop_prefix, sse
from batchrun.server.metrics import ServerMetrics
from batchrun.server.protocol import ChatCompletionRequest, CompletionRequest

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
DISCONNECT_POLL_S = 0.1
MAX_BODY_BYTES = 4 << 20
BODY_TIMEOUT_S = 30.0


def create_app(llm, api_key: str | None = None, model_name: str | None = None, max_prompt_tokens: int | None = None,
               max_tokens_limit: int | None = None, ready: Callable[[], bool] | None = None,
               lane: str = "interactive", max_body_bytes: int = MAX_BODY_BYTES,
               body_timeout_s: float = BODY_TIMEOUT_S) -> FastAPI:
    """ready: returns False while requests cannot progress (answered 503); default: always ready.
    lane: the engine lane of served requests ("batch" only to measure one shared FIFO pool).
    max_body_bytes: larger request bodies get 413 before they are read whole; body_timeout_s: a body that has not
    arrived within this time gets 408 (a slow client does not hold its connection forever)."""
    max_len = llm.engine.max_model_len
    server = _Server(llm, model_name or llm.model_path, min(max_prompt_tokens or max_len - 1, max_len - 1),
                     min(max_tokens_limit or max_len, max_len), ready or (lambda: True), lane)
    app = FastAPI(title="batchrun", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(_Guard, api_key=api_key, metrics=server.metrics, max_body_bytes=max_body_bytes,
                       body_timeout_s=body_timeout_s)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        return _validation_api_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()

    @app.get("/health")
    async def health():
        if not llm.healthy:
            return JSONResponse({"status": f"engine failed: {llm.loop_error}"}, status_code=503)
        ok = server.ready()
        return JSONResponse({"status": "ok" if ok else "not ready"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        base = {"id": server.model_name, "object": "model", "created": server.started, "owned_by": "batchrun",
                "max_model_len": max_len}
        # each LoRA adapter is a model of its own whose parent is the base (as vLLM lists them)
        return {"object": "list", "data": [base, *({**base, "id": name, "parent": server.model_name}
                                                   for name in server.adapters)]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.serve(body, request, CompletionFormat, body.engine_prompt, "prompt",
                                  body.max_tokens, "max_tokens", default_max_tokens=16,
                                  logprobs=body.logprobs is not None)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        return await server.serve(body, request, ChatFormat, body.engine_messages, "messages",
                                  body.requested_max_tokens, param, default_max_tokens=None,
                                  logprobs=bool(body.logprobs))

    return app


class _Server:
    def __init__(self, llm, model_name: str, max_prompt_tokens: int, max_tokens_limit: int, ready, lane: str):
        self.llm, self.model_name, self.ready, self.lane = llm, model_name, ready, lane
        self.max_prompt_tokens, self.max_tokens_limit = max_prompt_tokens, max_tokens_limit
        self.metrics = ServerMetrics(lambda: llm.engine.stats)
        self.started = int(time.time())

    async def serve(self, body, request: Request, fmt_cls: type[Format], get_prompt, prompt_param: str,
                    max_tokens: int | None, max_tokens_param: str, default_max_tokens: int | None, logprobs: bool):
        arrival = time.monotonic()
        body.check_supported()
        adapter = self._adapter(body.model)
        if not self.llm.healthy:
            raise APIError(503, f"engine failed: {self.llm.loop_error}; restart the server", type="server_error",
                           code="engine_failed")
        if not self.ready():
            raise APIError(503, "the engine is not accepting requests (starting, stopping or its job is finishing)",
                           type="server_error", code="engine_not_ready", headers={"Retry-After": "1"})
        token_ids = self._encode(get_prompt(), prompt_param)
        params = body.sampling_params(self._max_tokens(len(token_ids), max_tokens, max_tokens_param,
                                                       default_max_tokens), logprobs)
        if adapter is not None:
            params = dataclasses.replace(params, adapter=adapter)
        fmt = fmt_cls(f"{'chatcmpl' if fmt_cls is ChatFormat else 'cmpl'}-{uuid.uuid4().hex}",
                      adapter or self.model_name, self.llm.tokenizer)
        try:
            handle = self.llm.submit(token_ids, params, lane=self.lane, request_id=fmt.id)
        except EngineOverloaded as exc:
            raise APIError(429, f"server overloaded: {exc}", type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"}) from exc
        if body.stream:
            return StreamingResponse(self._events(handle, fmt, request, arrival, params.stop, logprobs,
                                                  body.include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._complete(handle, fmt, request, arrival, logprobs)

    @property
    def adapters(self) -> list[str]:
        adapters = self.llm.engine.adapters
        return list(adapters.files) if adapters is not None else []

    def _adapter(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names; None for the base model (or no model); 404 for anything else."""
        if model is None or model == self.model_name:
            return None
        if model in self.adapters:
            return model
        served = ", ".join(repr(m) for m in [self.model_name, *self.adapters])
        raise APIError(404, f"model: {model!r} is not served here; this server serves {served} (see /v1/models)",
                       "model", code="model_not_found")

    def _encode(self, prompt, param: str) -> list[int]:
        try:
            token_ids = self.llm.encode(prompt)
        except ValueError as exc:
            raise from_value_error(exc, param) from exc
        except Exception as exc:   # e.g. a chat template that rejects the roles' order
            raise bad_request(f"{param}: cannot apply the chat template: {exc}", param) from exc
        vocab = self.llm.engine.hf_config.vocab_size
        if not token_ids:
            raise bad_request(f"{param}: the prompt encodes to no tokens", param)
        if any(not 0 <= t < vocab for t in token_ids):
            raise bad_request(f"{param}: token ids must be in [0, {vocab})", param)
        if len(token_ids) > self.max_prompt_tokens:
            raise bad_request(f"{param}: {len(token_ids)} prompt tokens exceed this server's limit of "
                              f"{self.max_prompt_tokens}; shorten the prompt", param)
        return token_ids

    def _max_tokens(self, prompt_len: int, requested: int | None, param: str, default: int | None) -> int:
        room = self.llm.engine.max_model_len - prompt_len
        if requested is None:
            return max(1, min(default or self.max_tokens_limit, self.max_tokens_limit, room))
        if requested <= 0:
            raise bad_request(f"{param}: must be a positive integer, got {requested}", param)
        if requested > self.max_tokens_limit:
            raise bad_request(f"{param}: {requested} exceeds this server's limit of {self.max_tokens_limit}", param)
        if requested > room:
            raise bad_request(f"{param}: the prompt ({prompt_len} tokens) plus {param} ({requested}) exceeds the "
                              f"context of {self.llm.engine.max_model_len} tokens; ask for at most {room}", param)
        return requested

    async def _complete(self, handle: RequestHandle, fmt: Format, request: Request, arrival: float, logprobs: bool):
        watcher = asyncio.create_task(_cancel_on_disconnect(request, handle))
        self.metrics.in_flight.inc()
        try:
            outs = []
            async for chunk in handle.astream():
                self._first_token(chunk, arrival)
                if chunk.last:
                    outs = chunk.output.prompt_outputs
        finally:
            self.metrics.in_flight.dec()
            watcher.cancel()
            if not handle.done:
                handle.cancel()
        for out in outs or [None]:
            _raise_for(out)
        self.metrics.count_tokens(outs[0].prompt_tokens, sum(len(o.token_ids) for o in outs))
        return fmt.full(outs, logprobs)

    def _first_token(self, chunk, arrival: float) -> None:
        if chunk.new_token_ids and len(chunk.output.token_ids) == len(chunk.new_token_ids):
            self.metrics.observe_ttft(time.monotonic() - arrival)

    async def _events(self, handle: RequestHandle, fmt: Format, request: Request, arrival: float, stops: list[str],
                      logprobs: bool, include_usage: bool):
        """SSE body. Cancelled by Starlette when the client goes away: the finally aborts the request."""
        self.metrics.in_flight.inc()
        sent, decoded, offset = "", "", 0
        role_due = isinstance(fmt, ChatFormat)   # sent with the first token, as vLLM does: clients time TTFT by it
        try:
            async for chunk in handle.astream():
                self._first_token(chunk, arrival)
                out = chunk.output
                if out.finish_reason in ("error", "abort"):
                    yield sse(_error_for(out).body())
                    break
                if role_due:
                    yield sse(fmt.role_chunk())
                    role_due = False
                if chunk.finished:
                    text = out.text or ""
                    delta = text[len(sent):] if text.startswith(sent) else ""
                else:
                    decoded += chunk.new_text
                    delta = hold_back_stop_prefix(decoded, stops)[len(sent):]
                sent += delta
                lp = None
                if logprobs and chunk.new_token_ids:
                    lp = fmt.logprobs(chunk.new_token_ids, (out.logprobs or [])[-len(chunk.new_token_ids):], offset)
                    offset += sum(len(t) for t in lp.get("tokens", []))
                if delta or chunk.finished or lp or chunk.new_token_ids:   # a chunk per token, even one with no text
                    yield sse(fmt.chunk(delta, out.finish_reason if chunk.finished else None, lp))
                if chunk.finished:
                    self.metrics.count_tokens(out.prompt_tokens, len(out.token_ids))
                    if include_usage:
                        yield sse(fmt.usage_chunk(out))
            yield SSE_DONE
        finally:
            self.metrics.in_flight.dec()
            if not handle.done:
                handle.cancel()


async def _cancel_on_disconnect(request: Request, handle: RequestHandle) -> None:
    while not handle.done:
        if await request.is_disconnected():
            handle.cancel()
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


def _error_for(out) -> APIError:
    if out.finish_reason == "abort":
        return APIError(503, "the request was aborted (the server or its job is stopping)", type="server_error")
    if (out.error or "").startswith("prompt:"):
        return bad_request(out.error, "prompt")
    return APIError(500, f"generation failed: {out.error}", type="server_error")


def _raise_for(out) -> None:
    if out is None or out.finish_reason in ("error", "abort"):
        raise _error_for(out) if out is not None else APIError(500, "no output", type="server_error")


def _validation_api_error(exc: RequestValidationError) -> APIError:
    err = exc.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return bad_request(f"body: invalid JSON ({err.get('ctx', {}).get('error', err.get('msg'))})")
    if not loc:
        return bad_request(f"body: expected a JSON object ({err.get('msg')})")
    # "stop.str" / "stop.list[str].0": the union member names are noise for a client
    param = ".".join(x for x in loc if not (x[:1].islower() and ("[" in x or x in {"str", "int", "float", "bool"})))
    return bad_request(f"{param}: {err.get('msg')}", param)


class _Guard:
    """Pure ASGI middleware (streaming-safe): bearer token on /v1/*, a bound on the request body's size and on the
    time it takes to arrive, request counts by route and status."""

    def __init__(self, app, api_key: str | None, metrics: ServerMetrics, max_body_bytes: int, body_timeout_s: float):
        self.app, self.metrics = app, metrics
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.expected and path.startswith("/v1/") and not self._authorized(scope):
                error = APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                 code="invalid_api_key")
                await error.response()(scope, receive, send_status)
            elif self._declared_length(scope) > self.max_body_bytes:
                await self._too_large().response()(scope, receive, send_status)
            else:
                await self.app(scope, *self._bounded(scope, receive, send_status))
        finally:
            self.metrics.count_request(path if path in ROUTES else "other", status[0])

    @staticmethod
    def _declared_length(scope) -> int:
        value = next((v for k, v in scope["headers"] if k == b"content-length"), b"0")
        return int(value) if value.isdigit() else 0

    def _too_large(self) -> APIError:
        return APIError(413, f"body: larger than this server's limit of {self.max_body_bytes} bytes")

    def _bounded(self, scope, receive, send):
        """(receive, send) for the app: receive counts the body's bytes (a chunked body declares no length) and
        times its arrival; past a bound the answer (413 or 408) is sent here, the app sees a disconnect and what it
        sends is dropped. Once the body is complete (later receives wait for a disconnect) both are left alone."""
        received, complete, answered = 0, False, False

        async def reject(error: APIError):
            nonlocal answered
            await error.response()(scope, receive, send)
            answered = True
            return {"type": "http.disconnect"}

        async def bounded_receive():
            nonlocal received, complete
            if complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout_s)
            except asyncio.TimeoutError:
                return await reject(APIError(408, f"body: not received within {self.body_timeout_s:g} s"))
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    return await reject(self._too_large())
                complete = not message.get("more_body", False)
            return message

        async def app_send(message):
            if not answered:
                await send(message)
        return bounded_receive, app_send

    def _authorized(self, scope) -> bool:
        got = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        return hmac.compare_digest(got, self.expected)
