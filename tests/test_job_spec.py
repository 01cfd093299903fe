"""Job files: every error names the field and the line; --set overrides; validate loads no model."""
import json
import re

import pytest
from click.testing import CliRunner

from batchrun.cli import main
from batchrun.job import JobError, JobSpec
from jobkit import write_job, write_prompts

BASE = "model: m\ninput:\n  path: in.parquet\noutput:\n  path: out\n"


def spec_error(tmp_path, text: str, *overrides) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(JobError) as info:
        JobSpec.from_yaml(str(path), list(overrides))
    assert info.value.exit_code == 2
    return str(info.value)


@pytest.mark.parametrize("text, message", [
    (BASE + "sampling:\n  max_tokns: 5\n", r"sampling.max_tokns \(line 7\): unknown key; did you mean 'max_tokens'"),
    (BASE + "batchng:\n  window: 5\n", r"batchng \(line 6\): unknown key; did you mean 'batching'"),
    (BASE + "sampling:\n  temperature: hot\n", r"sampling.temperature \(line 7\): must be a number, got 'hot'"),
    (BASE + "sampling:\n  max_tokens: 0\n", r"sampling.max_tokens \(line 7\): must be a positive integer"),
    (BASE + "sampling:\n  top_p: 2\n", r"sampling.top_p \(line 7\): must be a number in \(0, 1\]"),
    (BASE + "input2: {}\n", r"unknown key; did you mean 'input'"),
    (BASE.replace("  path: in.parquet\n", "  id_column: id\n"), r"input \(line 2\): path is required"),
    (BASE + "engine:\n  kv_cache_dtype: int4\n", r"engine.kv_cache_dtype \(line 7\): unknown value 'int4'"),
    (BASE + "engine:\n  kv_cache_memory: lots\n", r"engine.kv_cache_memory \(line 7\): cannot parse 'lots'"),
    (BASE + "engine:\n  max_num_seqs: true\n", r"engine.max_num_seqs \(line 7\): must be an integer, got True"),
    (BASE.replace("path: out", "path: out\n  order: random"), r"output.order \(line 6\): unknown value 'random'; "
                                                              r"allowed"),
    (BASE + "sampling:\n  max_tokens: 5\nsampling:\n  seed: 1\n", r"sampling is given twice \(lines 6 and 8\)"),
    (BASE.replace("in.parquet", "in.parquet\n  template: 'Hi {'"), r"input.template \(line 4\): not a valid"),
    (BASE.replace("in.parquet", "in.parquet\n  template: 'no fields'"), r"needs \{column\} placeholders"),
    (BASE.replace("in.parquet", "in.parquet\n  prompt_column: p\n  messages_column: m"),
     r"input.messages_column \(line 5\): give one of"),
    (BASE.replace("in.parquet", "in.parquet\n  system_prompt: Be brief."), r"system_prompt \(line 4\): needs chat"),
    ("- a\n- b\n", "must be a mapping"),
    ("model: [unclosed\n", "not valid YAML"),
])
def test_bad_spec_names_field_and_line(tmp_path, text, message):
    assert re.search(message, spec_error(tmp_path, text))


def test_set_overrides_and_errors(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(BASE)
    spec = JobSpec.from_yaml(str(path), ["input.limit=20", "sampling.stop=[END]", "batching.bucketing=false"])
    assert spec.input.limit == 20 and spec.sampling.stop == ["END"] and spec.batching.bucketing is False
    assert "input.limit (from --set): must be a positive integer" in spec_error(tmp_path, BASE, "input.limit=-1")
    assert "expected key=value" in spec_error(tmp_path, BASE, "input.limit")
    assert "did you mean 'limit'" in spec_error(tmp_path, BASE, "input.limt=3")


def test_paths_are_relative_to_the_job_file(tmp_path):
    path = tmp_path / "jobs" / "job.yaml"
    path.parent.mkdir()
    path.write_text(BASE)
    spec = JobSpec.from_yaml(str(path))
    assert spec.resolve(spec.input.path) == str(tmp_path / "jobs" / "in.parquet")


def test_missing_job_file_exit_code(tmp_path):
    result = CliRunner().invoke(main, ["validate", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2 and "cannot read the job file" in result.output


def test_validate_reports_without_loading_the_model(tmp_path, tiny_model, monkeypatch):
    import batchrun.engine.engine as engine_module
    monkeypatch.setattr(engine_module.Engine, "__init__", lambda *a, **k: pytest.fail("validate loaded the model"))
    write_prompts(tmp_path / "in.parquet", 20)
    job = write_job(tmp_path, tiny_model[0], input={"limit": 12})
    result = CliRunner().invoke(main, ["validate", job, "--set", "sampling.max_tokens=9"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["rows"] == 12 and report["rows_failing_before_generation"] == 0
    assert 0 < report["prompt_tokens"]["p50"] <= report["prompt_tokens"]["max"]
    # tiny Llama: 2 layers x 2 KV heads x head_dim 16 x float32, K and V
    assert report["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert report["output_state"] == "new" and not (tmp_path / "out").exists()


def test_engine_section_accepts_interactive_lane_options(tmp_path, tiny_model):
    from batchrun.job.spec import JobSpec
    from jobkit import write_job
    job = write_job(tmp_path, tiny_model[0], engine={"interactive_lane": True, "interactive_kv_memory": "1MiB",
                                                     "interactive_max_num_seqs": 2})
    options = JobSpec.from_yaml(job).engine_options
    assert options["interactive_lane"] is True and options["interactive_max_num_seqs"] == 2


def test_engine_and_sampling_keys_come_from_engine_config_and_sampling_params():
    import dataclasses
    from batchrun.config import EngineConfig
    from batchrun.job.sections import EngineSection, SamplingSection
    from batchrun.sampling_params import SamplingParams
    assert set(EngineSection.model_fields) == {f.name for f in dataclasses.fields(EngineConfig)} - {"model"} | {"lane"}
    assert set(SamplingSection.model_fields) == ({f.name for f in dataclasses.fields(SamplingParams)} - {"logprobs", "prompt_logprobs"}
                                               | {"json_schema_file"})
    spec = JobSpec({"input": {"path": "in.parquet"}, "output": {"path": "out"}, "engine": {"block_size": None}})
    assert spec.engine.max_num_seqs == EngineConfig.max_num_seqs and spec.engine_options == {}   # null: not set
    assert spec.sampling_params().top_p == SamplingParams().top_p and spec.sampling_params().max_tokens == 64


def test_schema_command_gives_a_json_schema_the_shipped_jobs_satisfy(tmp_path):
    import glob
    import jsonschema
    import yaml
    result = CliRunner().invoke(main, ["schema"])
    assert result.exit_code == 0
    schema = json.loads(result.output)
    jsonschema.Draft202012Validator.check_schema(schema)
    engine = schema["$defs"]["EngineSection"]["properties"]
    assert "int8" in json.dumps(engine["kv_cache_dtype"]) and engine["max_num_seqs"]["default"] == 128
    jobs = glob.glob("jobs/*.yaml")
    assert jobs
    for path in jobs:
        with open(path) as f:
            jsonschema.validate(yaml.safe_load(f), schema)
    with pytest.raises(jsonschema.ValidationError, match="max_tokns"):
        jsonschema.validate(yaml.safe_load(BASE + "sampling:\n  max_tokns: 5\n"), schema)


@pytest.mark.parametrize("text, message", [
    (BASE.replace("in.parquet", "in.parquet\n  passthrough: [a, 3]"),
     r"input.passthrough \(line 4\): must be a list of strings, item 1 is 3"),
    (BASE + "engine:\n  kv_cache_memory: [1]\n", r"engine.kv_cache_memory \(line 7\): must be a string or an integer"),
    (BASE + "engine:\n  lane: fast\n", r"engine.lane \(line 7\): unknown value 'fast'; allowed: batch, interactive"),
    (BASE + "kv_quality_gate:\n  min_identical: 1.5\n", r"kv_quality_gate.min_identical \(line 7\): must be <= 1"),
    (BASE + "sampling: 5\n", r"sampling \(line 6\): must be a mapping of max_tokens"),
])
def test_typed_sections_explain_errors_in_our_words(tmp_path, text, message):
    assert re.search(message, spec_error(tmp_path, text))


def test_a_job_file_cannot_construct_python_objects(tmp_path):
    # the loader is yaml.SafeLoader's (plus the duplicate-key check): a python tag is an error, never executed
    job = tmp_path / "evil.yaml"
    marker = tmp_path / "ran"
    job.write_text(f"name: !!python/object/apply:os.system ['touch {marker}']\n"
                   "input: {path: in.parquet}\noutput: {path: out}\n")
    with pytest.raises(JobError, match="not valid YAML"):
        JobSpec.from_yaml(str(job))
    assert not marker.exists()
