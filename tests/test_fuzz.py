"""Property-based fuzzing of every input surface with Hypothesis: SamplingParams (the one door every value passes),
job files, Parquet row values, OpenAI batch lines and server bodies. Hostile values: NaN and +-inf, huge and
negative integers, wrong types at any depth, unicode, nesting.

Invariants: no traceback (only the documented error types, carrying a message), a documented exit code or HTTP
status, a bad row fails alone, nothing lost (every input line comes out once), the engine and the server stay usable.

The default suite runs a fixed, derandomized set of examples (the `ci` profile). A longer campaign by hand:
    BATCHRUN_FUZZ=long python -m pytest tests/test_fuzz.py --hypothesis-show-statistics
"""
from __future__ import annotations

import json
import math
import os

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from batchrun import SamplingParams
from batchrun.job import Job, JobError
from batchrun.job.source import row_from_record
from batchrun.job.spec import JobSpec
from batchrun.sampling_params import INT64_MAX, SEED_MAX
from jobkit import write_job, write_prompts

settings.register_profile("ci", derandomize=True, deadline=None, max_examples=60, print_blob=True,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
settings.register_profile("long", deadline=None, max_examples=2000, print_blob=True,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
settings.load_profile(os.environ.get("BATCHRUN_FUZZ", "ci"))

FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e-300, 1.0, 2.0]))
BIG_INTS = st.one_of(st.integers(-2**70, 2**70), st.sampled_from([-1, 0, 1, INT64_MAX, INT64_MAX + 1, SEED_MAX,
                                                                  SEED_MAX + 1, -2**63, -2**63 - 1, 10**30]))
TEXT = st.text(max_size=12)
SCALARS = st.one_of(st.none(), st.booleans(), BIG_INTS, FLOATS, TEXT)
ANY_JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(TEXT, inner, max_size=3)), max_leaves=8)
# What a hostile client or file puts in each sampling field: sometimes a plausible value, often not.
FIELD_VALUES = {
    "max_tokens": st.one_of(st.integers(1, 4), BIG_INTS, ANY_JSON),
    "temperature": st.one_of(FLOATS, ANY_JSON), "top_p": st.one_of(FLOATS, ANY_JSON),
    "top_k": st.one_of(BIG_INTS, ANY_JSON), "seed": st.one_of(BIG_INTS, ANY_JSON),
    "stop": st.one_of(TEXT, st.lists(st.one_of(TEXT, BIG_INTS, FLOATS), max_size=3), ANY_JSON),
    "stop_token_ids": st.one_of(st.lists(st.one_of(BIG_INTS, FLOATS, TEXT), max_size=3), ANY_JSON),
    "ignore_eos": st.one_of(st.booleans(), ANY_JSON), "n": st.one_of(st.integers(-2, 3), BIG_INTS, ANY_JSON),
    "regex": st.one_of(st.sampled_from([r"\d+", r"[^\s\S]", r"ab[^\s\S]", "((", "", "a{0}"]), ANY_JSON),
    "choice": st.one_of(st.lists(TEXT, max_size=3), ANY_JSON),
    "json_schema": st.one_of(st.sampled_from([{"type": "string"}, {"enum": []}, {"type": "integer", "minimum": 5,
                                                                                  "maximum": 1}, "[1]", "{"]),
                             ANY_JSON)}
SAMPLING = st.fixed_dictionaries({}, optional=FIELD_VALUES)


def _params_or_error(fields: dict) -> SamplingParams | None:
    """SamplingParams from hostile fields: built, or a ValueError whose message names the field first."""
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        assert str(exc).split(":", 1)[0] in FIELD_VALUES, str(exc)
        return None


@given(SAMPLING)
def test_sampling_params_accept_or_name_the_field(fields):
    params = _params_or_error(fields)
    if params is not None:   # what passes is what the engine can use
        assert math.isfinite(params.temperature) and 0 < params.top_p <= 1 and params.max_tokens >= 1
        assert all(isinstance(s, str) for s in params.stop) and params.n >= 1
        assert params.seed is None or -2**63 <= params.seed <= SEED_MAX


@pytest.fixture(scope="module")
def fuzz_llm(tiny_model):
    from batchrun import LLM
    return LLM(model=tiny_model[0], kv_cache_memory="4MiB", block_size=4, max_num_batched_tokens=64)


@given(st.lists(SAMPLING, min_size=1, max_size=3))
def test_whatever_passes_validation_runs_beside_a_good_request(fuzz_llm, many):
    """Requests built from hostile values that pass validation run in one batch with a good request: each ends with
    a documented reason, a non-error output is not empty, and the good request is untouched."""
    good = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    hostile = [p for p in map(_params_or_error, many) if p is not None and p.max_tokens <= 4]
    outs = fuzz_llm.generate([[5, 6, 7]] * (len(hostile) + 1), [good, *hostile], use_tqdm=False)
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == 3
    for out in outs[1:]:
        assert out.finish_reason in ("stop", "length", "error")
        assert (out.error is not None) if out.finish_reason == "error" else len(out.token_ids) > 0
    assert fuzz_llm.engine.block_manager.num_free_blocks == fuzz_llm.engine.block_manager.num_blocks


JOB_SECTIONS = st.fixed_dictionaries({}, optional={
    "sampling": st.one_of(SAMPLING, ANY_JSON),
    "engine": st.one_of(st.fixed_dictionaries({}, optional={
        k: st.one_of(BIG_INTS, FLOATS, TEXT, ANY_JSON) for k in (
            "max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory", "gpu_memory_utilization",
            "kv_cache_dtype", "max_model_len", "interactive_token_share", "seed")}), ANY_JSON),
    "input": st.one_of(st.fixed_dictionaries({}, optional={
        k: st.one_of(TEXT, BIG_INTS, ANY_JSON) for k in ("limit", "truncate", "template", "temperature_column",
                                                         "format", "passthrough")}), ANY_JSON),
    "deadline": ANY_JSON, "batching": ANY_JSON, "output": ANY_JSON})


@given(JOB_SECTIONS)
def test_job_files_load_or_fail_with_a_job_error(tmp_path_factory, tiny_model, sections):
    """A hostile job file is a JobError naming what is wrong (exit 2), never another exception."""
    tmp = tmp_path_factory.mktemp("job")
    write_prompts(tmp / "in.parquet", 3)
    spec = {"model": tiny_model[0], "input": {"path": "in.parquet"}, "output": {"path": "out"}}
    for key, value in sections.items():
        spec[key] = {**spec[key], **value} if isinstance(spec.get(key), dict) and isinstance(value, dict) else value
    path = tmp / "job.yaml"
    try:
        path.write_text(yaml.safe_dump(spec, allow_unicode=True))
    except yaml.YAMLError:
        return
    try:
        JobSpec.from_yaml(str(path))
    except JobError as exc:
        assert exc.exit_code == 2 and str(exc) and "<class" not in str(exc)


ROW_VALUES = st.fixed_dictionaries({
    "max_tokens": st.one_of(st.none(), st.integers(-2**63, INT64_MAX)),
    "temperature": st.one_of(st.none(), FLOATS), "top_p": st.one_of(st.none(), FLOATS),
    "seed": st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    "schema": st.one_of(st.none(), TEXT, st.sampled_from(['{"type": "string"}', '{"enum": []}', "[1]"]))})


@given(st.lists(ROW_VALUES, min_size=1, max_size=6))
def test_row_values_fail_their_row_alone(tmp_path_factory, tiny_model, rows):
    """Any value an Arrow column of the right type can hold: the row gets params or its own error, never raises."""
    tmp = tmp_path_factory.mktemp("rows")
    write_prompts(tmp / "in.parquet", 1)
    job = write_job(tmp, tiny_model[0], input={"max_tokens_column": "mt", "temperature_column": "t",
                                               "top_p_column": "p", "seed_column": "s", "json_schema_column": "js"})
    spec = JobSpec.from_yaml(job)
    for i, values in enumerate(rows):
        record = {"id": f"r{i}", "prompt": "hi", "mt": values["max_tokens"], "t": values["temperature"],
                  "p": values["top_p"], "s": values["seed"], "js": values["schema"]}
        row = row_from_record(spec, i, record)
        assert (row.params is None) == (row.error is not None)
        if row.error:
            assert "(column '" in row.error, row.error


JSONL_LINES = st.one_of(
    ANY_JSON.map(json.dumps),
    st.fixed_dictionaries({"custom_id": st.one_of(TEXT, ANY_JSON), "url": st.sampled_from(
        ["/v1/completions", "/v1/chat/completions", "/v1/embeddings"]), "body": st.one_of(
        st.fixed_dictionaries({"prompt": st.one_of(TEXT, ANY_JSON)}, optional={
            "max_tokens": st.one_of(st.integers(1, 3), ANY_JSON), **{k: FIELD_VALUES[k] for k in (
                "temperature", "top_p", "seed", "stop", "n")}}),
        st.fixed_dictionaries({"messages": st.one_of(st.just([{"role": "user", "content": "hi"}]), ANY_JSON)},
                              optional={"max_tokens": st.integers(1, 3), "response_format": ANY_JSON}),
        ANY_JSON)}).map(lambda d: json.dumps(d, allow_nan=True)),
    st.binary(max_size=20).map(lambda b: b.decode("latin1")))


@settings(max_examples=4 if os.environ.get("BATCHRUN_FUZZ", "ci") == "ci" else 100)
@given(st.lists(JSONL_LINES, min_size=1, max_size=12))
def test_openai_batch_lines_each_come_out_once_and_bad_ones_fail_alone(tmp_path_factory, tiny_model, lines):
    """A whole job over hostile lines beside a good one: the job ends with a documented code, every line has its
    output row(s), the good line is ok."""
    good = json.dumps({"custom_id": "good", "url": "/v1/completions", "body": {"prompt": "hello", "max_tokens": 2}})
    tmp = tmp_path_factory.mktemp("jsonl")
    lines = [line.replace("\n", " ").replace("\r", " ").replace("\x85", " ").replace("\u2028", " ")
             .replace("\u2029", " ") for line in lines]
    (tmp / "in.jsonl").write_text("\n".join([good, *lines]) + "\n", encoding="utf-8")
    job = write_job(tmp, tiny_model[0], input={"path": "in.jsonl", "allow_duplicate_ids": True},
                    sampling={"max_tokens": 2})
    result = Job.from_yaml(job).run(progress="log")
    assert result.exit_code in (0, 3)
    table = result.table().to_pylist()
    non_blank = [line for line in [good, *lines] if line.strip()]   # blank lines are skipped, not rows
    assert sorted({r["row_index"] for r in table}) == list(range(len(non_blank)))
    good_rows = [r for r in table if r["row_index"] == 0]
    assert [r["status"] for r in good_rows] == ["ok"]
    for r in table:
        assert (r["status"] == "error") == (r["error"] is not None)
        assert r["status"] == "error" or r["completion_tokens"] > 0


SERVER_BODIES = st.fixed_dictionaries({}, optional={
    "prompt": st.one_of(st.just("hello"), st.lists(st.integers(-3, 300), max_size=4), ANY_JSON),
    "messages": st.one_of(st.just([{"role": "user", "content": "hi"}]), ANY_JSON),
    "max_tokens": st.one_of(st.integers(1, 3), BIG_INTS, ANY_JSON), "n": st.one_of(st.integers(1, 2), ANY_JSON),
    "stream": st.one_of(st.booleans(), ANY_JSON), "response_format": ANY_JSON, "logprobs": ANY_JSON,
    **{k: FIELD_VALUES[k] for k in ("temperature", "top_p", "seed", "stop", "top_k", "stop_token_ids",
                                    "ignore_eos")}})


@pytest.fixture(scope="module")
def server(fuzz_llm):
    pytest.importorskip("fastapi")
    from batchrun.server import ServerThread, create_app
    fuzz_llm.start_background()
    thread = ServerThread(create_app(fuzz_llm, model_name="tiny", max_tokens_limit=8)).start()
    yield thread
    thread.stop()
    fuzz_llm.stop_background()


@given(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), SERVER_BODIES)
def test_server_bodies_get_a_documented_status_and_the_server_stays_healthy(server, route, body):
    response = httpx.post(server.url + route, content=json.dumps(body, allow_nan=True),
                          headers={"Content-Type": "application/json"}, timeout=60)
    assert response.status_code in (200, 400, 404), response.text
    if response.status_code != 200:
        error = response.json()["error"]
        assert error["message"] and "Traceback" not in error["message"]
    elif not body.get("stream"):
        choices = response.json()["choices"]
        assert choices and all(c["finish_reason"] in ("stop", "length") for c in choices)
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def test_dictionary_encoded_row_values(tmp_path, tiny_model):
    """The fuzzed row path reads what pyarrow gives; a dictionary-encoded schema column reads the same."""
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["hi", "hello"],
                             "js": pa.array(['{"type": "string"}', "{"]).dictionary_encode()}), tmp_path / "in.parquet")
    job = write_job(tmp_path, tiny_model[0], input={"json_schema_column": "js"})
    rows = {r["id"]: r for r in Job.from_yaml(job).run(progress="log").table().to_pylist()}
    assert rows["a"]["status"] == "ok" and rows["b"]["error"].startswith("json_schema (column 'js'): not valid JSON")
