"""The OpenAI-compatible endpoint, driven by the official openai client against a real uvicorn server on the tiny
model: completions, chat, streaming, bad requests, tokens, overload, not ready, disconnects, a job alongside."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from batchrun import LLM  # noqa: E402
from batchrun.server import ServerThread, create_app  # noqa: E402
from conftest import reference_greedy  # noqa: E402

KEY = "test-key"
MAX_PROMPT, MAX_TOKENS = 64, 32


@pytest.fixture(scope="module")
def served(tiny_model):
    llm = LLM(model=tiny_model[0], kv_cache_memory="4MiB", block_size=4)
    state = {"ready": True}
    app = create_app(llm, api_key=KEY, model_name="tiny", max_prompt_tokens=MAX_PROMPT, max_tokens_limit=MAX_TOKENS,
                     ready=lambda: state["ready"])
    llm.start_background()
    server = ServerThread(app).start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    yield llm, server, client, state
    server.stop()
    llm.stop_background()


def _raw(server, path, body=None, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if body is None:
        return httpx.get(server.url + path, headers=headers, timeout=30)
    return httpx.post(server.url + path, json=body, headers=headers, timeout=30, **kw)


def test_completion_matches_transformers_greedy(served, tiny_model):
    llm, _, client, _ = served
    prompt = [5, 17, 42, 99, 7, 3]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    expected = reference_greedy(tiny_model[1], prompt, 6)
    assert r.object == "text_completion" and r.model == "tiny"
    assert r.choices[0].text == llm.tokenizer.decode(expected, skip_special_tokens=True)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (6, 6, 12)
    text = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=4, temperature=0)
    assert text.usage.prompt_tokens == len(llm.encode("The quick brown fox"))


def test_chat_and_models(served):
    llm, _, client, _ = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital?"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True)
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length") and r.usage.prompt_tokens == len(llm.encode(messages))
    assert len(choice.logprobs.content) == r.usage.completion_tokens
    assert all(t.logprob <= 0 for t in choice.logprobs.content)
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_streaming_equals_non_streaming(served):
    _, _, client, _ = served
    messages = [{"role": "user", "content": "Summarize the text."}]
    kw = dict(model="tiny", messages=messages, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert len([c for c in chunks if c.choices]) == 1 + 12   # the role, then one chunk per token

    text = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="The lazy dog", max_tokens=8, temperature=0, stream=True))
    assert text == client.completions.create(model="tiny", prompt="The lazy dog", max_tokens=8,
                                             temperature=0).choices[0].text
    raw = _raw(served[1], "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream") and raw.text.endswith("data: [DONE]\n\n")


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(max_tokens=MAX_TOKENS + 1), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(n=2, stream=True), "n"),
    (dict(n=0), "n"),
    (dict(extra_body={"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}}),
     "response_format"),
    (dict(extra_body={"response_format": {"type": "yaml"}}), "response_format"),
    (dict(prompt="fox " * (MAX_PROMPT + 10)), "prompt"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt=[1, 100000]), "prompt"),
    (dict(extra_body={"top_k": -5}), "top_k"),
    (dict(frequency_penalty=1.0), "frequency_penalty"),
])
def test_bad_completion_requests_name_the_field(served, kwargs, param):
    _, _, client, _ = served
    args = {"model": "tiny", "prompt": "hello", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**args)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param and param in err.value.body["message"]


def test_bad_chat_and_raw_requests(served):
    _, server, client, _ = served
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "hi"}])
    assert err.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[])
    assert err.value.body["param"] == "messages"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    for body, param in [({"model": "tiny"}, "prompt"), ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
                        ({"prompt": "x", "stream": "yes"}, "stream")]:
        r = _raw(server, "/v1/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and "invalid JSON" in r.json()["error"]["message"]


def test_wrong_or_missing_token_is_401(served):
    _, server, _, _ = served
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    assert _raw(server, "/v1/models", key=None).status_code == 401
    assert _raw(server, "/health", key=None).status_code == 200


def test_overload_is_429_and_not_ready_is_503(served):
    llm, server, client, state = served
    llm.stop_background()            # nothing steps: a submitted request stays in flight
    llm.max_pending_submits = 1
    try:
        first = {}
        t = threading.Thread(target=lambda: first.setdefault("r", client.completions.create(
            model="tiny", prompt="hi", max_tokens=3, temperature=0)))
        t.start()
        deadline = time.monotonic() + 10
        while "batchrun_http_requests_in_flight 1" not in _raw(server, "/metrics").text:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model="tiny", prompt="hi", max_tokens=3)
        assert err.value.status_code == 429
    finally:
        llm.max_pending_submits = 256
        llm.start_background()
    t.join(30)
    assert first["r"].usage.completion_tokens >= 1
    state["ready"] = False
    try:
        assert _raw(server, "/health").status_code == 503
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model="tiny", prompt="hi", max_tokens=3)
        assert err.value.status_code == 503
    finally:
        state["ready"] = True


def test_disconnect_cancels_and_frees_blocks(served, monkeypatch):
    llm, server, client, _ = served
    real_step = llm.step

    def slow_step():                # 32 tokens take > 1 s, so the disconnect lands mid-generation
        time.sleep(0.04)
        return real_step()

    monkeypatch.setattr(llm, "step", slow_step)
    tokens_before = llm.engine.stats.output_tokens
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi " * 5}],
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    it = iter(stream)
    while not next(it).choices[0].delta.content:
        pass
    assert llm.engine.stats.kv_blocks_used > 0
    stream.close()
    deadline = time.monotonic() + 5
    while llm.engine.stats.running or llm.engine.stats.kv_blocks_used:
        assert time.monotonic() < deadline, "blocks not freed after the client went away"
        time.sleep(0.02)
    assert llm.engine.stats.output_tokens - tokens_before < MAX_TOKENS


def test_metrics(served):
    _, server, client, _ = served
    client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    text = _raw(server, "/metrics", key=None).text
    assert 'batchrun_http_requests_total{route="/v1/completions",status="200"}' in text
    for name in ("batchrun_engine_kv_blocks_free", "batchrun_engine_preemptions_total",
                 "batchrun_interactive_completion_tokens_total", "batchrun_interactive_time_to_first_token_seconds_count"):
        assert name in text


def test_interactive_requests_complete_while_a_job_runs_and_the_job_is_exactly_once(tmp_path, tiny_model):
    from batchrun import Job
    from batchrun.server.thread import ServeBesideJob
    from jobkit import write_job, write_prompts

    ids = write_prompts(tmp_path / "in.parquet", 48)
    job = Job.from_yaml(write_job(tmp_path, tiny_model[0], sampling={"max_tokens": 16, "ignore_eos": True}))
    servers: list[ServeBesideJob] = []

    def serve(llm):
        real_step = llm.step

        def paced_step():            # keep the tiny job running for a few seconds, whatever the machine
            time.sleep(0.005)
            return real_step()

        llm.step = paced_step
        servers.append(ServeBesideJob(llm, "127.0.0.1:0", api_key=KEY, model_name="tiny"))
        return servers[-1]

    result = {}
    runner = threading.Thread(target=lambda: result.setdefault("job", job.run(progress="log", serve=serve)))
    runner.start()
    deadline = time.monotonic() + 60
    while not (servers and servers[0].thread.server.started):
        assert time.monotonic() < deadline and runner.is_alive(), "the server beside the job did not start"
        time.sleep(0.01)
    client = openai.OpenAI(base_url=servers[0].url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    answers, finished_during_job = [], []

    def ask(i):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"q{i}"}],
                                           max_tokens=4, temperature=0)
        answers.append(r)
        finished_during_job.append(runner.is_alive())

    askers = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for t in askers:
        t.start()
    for t in askers:
        t.join(60)
    runner.join(120)
    assert len(answers) == 6 and all(a.usage.completion_tokens >= 1 for a in answers)
    assert all(finished_during_job)
    table = result["job"].table()
    assert result["job"].exit_code == 0
    assert sorted(table.column("id").to_pylist()) == sorted(ids) and table.num_rows == len(ids)
    assert set(table.column("completion_tokens").to_pylist()) == {16}
    assert servers[0].thread.server.should_exit     # the endpoint went away with the job
    with pytest.raises(httpx.HTTPError):
        httpx.get(servers[0].url + "/health", timeout=2)


def test_stop_string_prefix_is_held_back_while_streaming():
    from batchrun.server.formats import hold_back_stop_prefix
    assert hold_back_stop_prefix("Hello wor", ["world"]) == "Hello "
    assert hold_back_stop_prefix("Hello w", ["xyz", "wo"]) == "Hello "
    assert hold_back_stop_prefix("Hello", ["world"]) == "Hello"
    assert hold_back_stop_prefix("ab", []) == "ab"


def test_a_failed_engine_step_fails_waiting_requests_and_health(tiny_model, monkeypatch):
    from batchrun import SamplingParams
    llm = LLM(model=tiny_model[0], kv_cache_memory="4MiB", block_size=4)

    def lost():
        raise RuntimeError("device lost")
    monkeypatch.setattr(llm.engine, "step", lost)
    server = ServerThread(create_app(llm, model_name="tiny")).start()
    try:
        handle = llm.submit("hello", SamplingParams(max_tokens=3))
        llm.start_background()
        out = handle.result(timeout=10)
        assert out.finish_reason == "error" and "device lost" in out.error and not llm.healthy
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 503 and "device lost" in health.json()["status"]
        refused = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503 and "engine failed" in refused.text
        with pytest.raises(RuntimeError, match="engine failed"):
            llm.submit("again")
    finally:
        server.stop()
        llm.stop_background()


def _send(url: str, head: list[str], body: bytes, pause_s: float = 0) -> tuple[int, str]:
    """A raw HTTP/1.1 request (headers as given, body possibly partial), then the status and body of the answer."""
    import http.client
    host, port = url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/v1/completions")
    for line in head:
        conn.putheader(*line.split(": ", 1))
    conn.endheaders()
    conn.send(body)
    time.sleep(pause_s)
    response = conn.getresponse()
    return response.status, response.read().decode()


def test_bad_bodies_get_clear_4xx_answers(served):
    llm = served[0]
    server = ServerThread(create_app(llm, model_name="tiny", max_body_bytes=200_000, body_timeout_s=0.5)).start()
    try:
        big = b'{"prompt": "' + b"a" * 300_000 + b'"}'
        status, text = _send(server.url, ["Content-Type: application/json", f"Content-Length: {len(big)}"], big)
        assert status == 413 and "limit of 200000 bytes" in text
        chunked = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (big[:150_000], big[150_000:])) + b"0\r\n\r\n"
        status, text = _send(server.url, ["Content-Type: application/json", "Transfer-Encoding: chunked"], chunked)
        assert status == 413
        status, text = _send(server.url, ["Content-Type: application/json", "Content-Length: 100"], b'{"pro',
                             pause_s=0.1)
        assert status == 408 and "not received within 0.5 s" in text
        for body in (b"{not json", b'{"prompt": "\xff\xfe", "max_tokens": 2}', b"[" * 50000 + b"]" * 50000):
            status, _ = _send(server.url, ["Content-Type: application/json", f"Content-Length: {len(body)}"], body)
            assert status == 400, body[:20]
        ok = b'{"prompt": "hi", "max_tokens": 2}'
        assert _send(server.url, ["Content-Type: application/json", f"Content-Length: {len(ok)}"], ok)[0] == 200
    finally:
        server.stop()


def test_n_choices_and_response_format(served):
    import json
    _, _, client, _ = served
    r = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=5, temperature=1.0, n=3,
                                  seed=4, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2] and len({c.text for c in r.choices}) > 1
    assert r.usage.completion_tokens == 15 and r.usage.prompt_tokens == len(served[0].encode("The quick brown fox"))
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Is it fine?"}], max_tokens=30, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    choice = chat.choices[0]
    assert choice.finish_reason == "stop" and json.loads(choice.message.content) in ({"ok": True}, {"ok": False})


def test_one_request_cannot_take_the_server_down(served, monkeypatch):
    """Values that used to pass the server and break the shared step are 400s naming the parameter; a request
    that still fails inside the step (injected here) fails alone, and the server stays healthy."""
    from test_engine_isolation import POISON_SEED, _PoisonedSampler
    llm, server, client, _ = served
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for raw, param in [(b'{"prompt": "hi", "max_tokens": 3, "seed": 1180591620717411303424}', "seed"),
                       (b'{"prompt": "hi", "max_tokens": 3, "temperature": NaN}', "temperature"),
                       (b'{"prompt": "hi", "max_tokens": 3, "top_p": Infinity}', "top_p"),
                       (b'{"prompt": "hi", "max_tokens": 3, "stop_token_ids": [-1]}', "stop_token_ids"),
                       (b'{"prompt": "hi", "max_tokens": 3, "response_format": {"type": "json_schema",'
                        b' "json_schema": {"schema": {"enum": []}}}}', "response_format")]:
        r = httpx.post(server.url + "/v1/completions", content=raw, headers=headers, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (raw, r.text)
    monkeypatch.setattr(llm.engine, "sampler", _PoisonedSampler(llm.engine.sampler))
    with pytest.raises(openai.InternalServerError, match="generation failed: sampling failed"):
        client.completions.create(model="tiny", prompt="hello", max_tokens=4, seed=POISON_SEED)
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert _raw(server, "/health").status_code == 200 and llm.healthy
