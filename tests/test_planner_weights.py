"""The planner with quantized weights: weight bytes per format, the KV room they leave, decode priced by the bytes
read, the format a checkpoint declares, and the job-file settings the recommendation gives."""
from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from batchrun.planner import plan as planner
from batchrun.planner.api import job_weights
from batchrun.stepmodel import catalog
from batchrun.stepmodel.costmodel import WEIGHT_FORMATS, ModelSpec, checkpoint_weights
from jobkit import plan, write_job, write_prompts
from test_planner import LLAMA3_8B, LLAMA3_70B, work

LLAMA32_1B = dict(LLAMA3_8B, hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
                  tie_word_embeddings=True)

FP8_ACTIVATIONS = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
COMPRESSED = {"quant_method": "compressed-tensors", "format": "float-quantized",
              "config_groups": {"group_0": {"targets": ["Linear"],
                                            "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                                            "input_activations": FP8_ACTIVATIONS}},
              "ignore": ["lm_head"]}


def test_weight_bytes_per_format_keep_embeddings_and_lm_head_16_bit():
    model = ModelSpec.from_config(LLAMA3_8B)
    plain = 2 * LLAMA3_8B["vocab_size"] * LLAMA3_8B["hidden_size"] + LLAMA3_8B["hidden_size"]   # untied
    for fmt, per_param in WEIGHT_FORMATS.items():
        quantized = dataclasses.replace(model, weights=fmt)
        assert quantized.weight_bytes == int((model.num_params - plain) * per_param + plain * 2)
    int8 = dataclasses.replace(model, weights="int8")
    assert 0.5 < int8.weight_bytes / model.weight_bytes < 0.6     # 8B: 1 GiB of 16-bit embeddings + lm_head


def test_a_70b_model_fits_one_h200_only_with_quantized_weights():
    p = planner.Planner(ModelSpec.from_config(LLAMA3_70B), work())
    h200 = catalog.select(catalog.load_catalog(), ["H200"])
    report = p.plan(h200, ("int8",), weights=("fp16", "int8", "int4"))
    rows = {r["weights"]: r for r in report["rows"]}
    alone = p.row_at(h200[0], "int8", "fp16", 1)
    assert not alone["fits"] and "weights" in alone["reason"]
    assert rows["fp16"]["fits"] and rows["fp16"]["tp"] == 2   # fp16: tensor parallel over 2
    assert rows["int8"]["fits"] and rows["int4"]["fits"] and rows["int8"]["tp"] == rows["int4"]["tp"] == 1
    assert rows["int4"]["kv_budget_gib"] > rows["int8"]["kv_budget_gib"] + 25      # ~32 GiB fewer weight bytes
    assert rows["int4"]["decode_step_ms"] < rows["int8"]["decode_step_ms"]          # decode reads fewer bytes
    rec = report["recommendation"]
    assert rec["weights"] in ("int8", "int4") and "weights" in rec["reason"]
    assert report["settings"]["checkpoint_weights"] == "fp16"
    # a 16-bit checkpoint is quantized at load; a quantized one runs as published
    assert planner.engine_stanza("int8", "int8", "fp16") == {"kv_cache_dtype": "int8", "quantization": "int8"}
    assert planner.engine_stanza("int8", "int4", "fp16") == {"kv_cache_dtype": "int8", "quantization": "int4"}
    assert "int8 checkpoint" in planner.engine_stanza("int8", "int8", "int4")["model"]
    assert planner.engine_stanza("fp8", "int4", "int4") == {"kv_cache_dtype": "fp8"}


def test_decode_on_a_bandwidth_bound_gpu_is_priced_by_the_weight_bytes():
    p = planner.Planner(ModelSpec.from_config(LLAMA3_8B), work())
    h100 = catalog.select(catalog.load_catalog(), ["H100"])
    rows = {r["weights"]: r for r in p.plan(h100, ("float16",), weights=("fp16", "int8"))["rows"]}
    ratio = rows["int8"]["decode_step_ms"] / rows["fp16"]["decode_step_ms"]
    assert 0.5 < ratio < 0.75, ratio      # weights halve; the KV read and the per-step overhead do not


@pytest.mark.parametrize("config,expected", [
    (None, "fp16"),
    (COMPRESSED, "fp8"),
    ({**COMPRESSED, "format": "int-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}}, "int8"),
    ({**COMPRESSED, "format": "pack-quantized", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}}, "int4"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}, "int4"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "int4"),
    ({**COMPRESSED, "ignore": []}, "fp8+head"),   # the LM head among the Linear targets
    ({**COMPRESSED, "ignore": ["re:.*lm_head"]}, "fp8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True}, "int4+head"),
])
def test_the_checkpoints_own_format(config, expected):
    assert checkpoint_weights(config) == expected
    model = ModelSpec.from_config(dict(LLAMA3_8B, quantization_config=config) if config else LLAMA3_8B)
    assert model.weight_format == expected and model.quantized_lm_head == expected.endswith("+head")
    if model.quantized_lm_head:   # a tied config's head read from its own tensors: a 16-bit embedding beside it
        tied = ModelSpec.from_config(dict(LLAMA32_1B, quantization_config=config))
        table = LLAMA32_1B["vocab_size"] * LLAMA32_1B["hidden_size"]
        assert not tied.tied_embeddings
        assert tied.weight_bytes_read(32) == tied.weight_bytes - 2 * table


def test_a_format_the_planner_cannot_size_is_named():
    nf4 = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    with pytest.raises(ValueError, match=r"bitsandbytes .*\('m'\); pass --weights"):
        ModelSpec.from_config(dict(LLAMA3_8B, quantization_config=nf4), name="m")
    with pytest.raises(ValueError, match="--weights: unknown value 'int3'"):
        planner.Planner(ModelSpec.from_config(LLAMA3_8B), work()).with_weights("int3")


def test_plan_command_compares_weight_formats(tmp_path, tiny_model):
    write_prompts(tmp_path / "in.parquet", n=12)
    job = write_job(tmp_path, tiny_model[0])
    out = plan(job, "--gpu", "L4", "--kv-dtype", "int8", "--weights", "fp16", "--weights", "int8", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert [r["weights"] for r in report["rows"]] == ["fp16", "int8"]
    assert report["rows"][1]["weights_gib"] < report["rows"][0]["weights_gib"]
    table = plan(job, "--gpu", "L4", "--weights", "int8")
    assert table.returncode == 0 and "int8" in table.stdout and "engine: {kv_cache_dtype:" in table.stdout
    bad = plan(job, "--weights", "int3")
    assert bad.returncode == 2 and "--weights" in bad.stderr


def test_a_quantized_lm_head_holds_and_reads_fewer_bytes():
    """int8+head: the head in int8 too. Untied (8B): the head's 16-bit table becomes int8, held and read. Tied (1B,
    on a GPU): the int8 lookup rows and the int8 head together hold what the 16-bit table did, but a decode step
    reads only the head's codes."""
    p = planner.Planner(ModelSpec.from_config(LLAMA3_8B), work())
    table = LLAMA3_8B["vocab_size"] * LLAMA3_8B["hidden_size"]
    int8, head = p.with_weights("int8"), p.with_weights("int8+head")
    assert (head.weights, head.quantized_lm_head, head.weight_format) == ("int8", True, "int8+head")
    assert int8.weight_bytes - head.weight_bytes == table                # 2 -> 1 byte a head parameter
    assert int8.weight_bytes_read(32) - head.weight_bytes_read(32) == table
    assert int8.weight_bytes_read(32) == int8.weight_bytes - 2 * table   # the 16-bit embedding is looked up

    tied = planner.Planner(ModelSpec.from_config(LLAMA32_1B), work())
    tied_table = LLAMA32_1B["vocab_size"] * LLAMA32_1B["hidden_size"]
    t8, t8_head = tied.with_weights("int8"), tied.with_weights("int8+head")
    assert t8_head.weight_bytes - t8.weight_bytes == 4 * LLAMA32_1B["vocab_size"]   # the rows' float32 scales
    assert t8.weight_bytes_read(32) == t8.weight_bytes                              # the table is the head
    assert t8.weight_bytes_read(32) - t8_head.weight_bytes_read(32) == tied_table   # read: int8 head, not 16-bit
    h100 = catalog.select(catalog.load_catalog(), ["H100"])
    rows = {r["weights"]: r for r in tied.plan(h100, ("int8",), weights=("int8", "int8+head"))["rows"]}
    assert rows["int8+head"]["decode_step_ms"] < rows["int8"]["decode_step_ms"]
    with pytest.raises(ValueError, match=r"--weights: unknown value 'fp16\+head'.*int8\+head"):
        tied.with_weights("fp16+head")


def test_the_recommendation_sets_the_lm_head_option():
    assert planner.engine_stanza("int8", "int8+head", "fp16") == {
        "kv_cache_dtype": "int8", "quantization": "int8", "quantization_lm_head": True}
    assert "16-bit checkpoint" in planner.engine_stanza("int8", "int8+head", "int4")["model"]
    # the job already quantizes at load: the same format changes nothing; fp16 turns it off
    assert planner.engine_stanza("fp8", "int8+head", "fp16", job_weights="int8+head") == {"kv_cache_dtype": "fp8"}
    assert planner.engine_stanza("fp8", "fp16", "fp16", job_weights="int8+head") == {
        "kv_cache_dtype": "fp8", "quantization": "none", "quantization_lm_head": False}
    assert planner.engine_stanza("fp8", "int8", "fp16", job_weights="int8+head") == {
        "kv_cache_dtype": "fp8", "quantization": "int8", "quantization_lm_head": False}


@pytest.mark.parametrize("engine,expected", [
    ({}, None),
    ({"quantization": "int8"}, "int8"),
    ({"quantization": "int8-w8a16", "quantization_lm_head": True}, "int8+head"),
    ({"quantization": "fp8"}, "fp8"),
    ({"quantization": "int4"}, "int4"),
])
def test_the_job_quantization_is_what_is_planned_by_default(engine, expected):
    spec = SimpleNamespace(engine=SimpleNamespace(**{"quantization": "none", "quantization_lm_head": False,
                                                    **engine}))
    model = ModelSpec.from_config(LLAMA3_8B)
    assert job_weights(spec, model) == expected
    assert job_weights(spec, dataclasses.replace(model, weights="int4")) is None   # a quantized checkpoint as is
    p = planner.Planner(model, work(), job_weights=expected)
    report = p.plan(catalog.select(catalog.load_catalog(), ["H100"]), ("int8",))
    assert [r["weights"] for r in report["rows"]] == [expected or "fp16"]
    assert report["settings"]["job_weights"] == (expected or "fp16")


def test_auto_quantization_is_planned_per_gpu_as_the_engine_picks_it():
    """engine.quantization auto: fp8 on a GPU with FP8 tensor cores (H100, L4), int8 elsewhere (A100); the
    recommendation leaves the setting alone where auto already picks its format."""
    spec = SimpleNamespace(engine=SimpleNamespace(quantization="auto", quantization_lm_head=True))
    model = ModelSpec.from_config(LLAMA3_8B)
    assert job_weights(spec, model) == "auto+head"
    p = planner.Planner(model, work(), job_weights="auto+head")
    report = p.plan(catalog.select(catalog.load_catalog(), ["H100", "A100-80GB", "L4"]), ("int8",))
    assert {r["gpu"]: r["weights"] for r in report["rows"]} == {
        "H100-80GB": "fp8+head", "A100-80GB": "int8+head", "L4": "fp8+head"}
    assert report["settings"]["job_weights"] == "auto+head"
    assert report["settings"]["weights"] == ["fp8+head", "int8+head"]
    rec = report["recommendation"]
    assert rec["engine"] == {"kv_cache_dtype": "int8"}   # auto already runs the recommended format there


def test_plan_command_plans_the_jobs_quantization(tmp_path, tiny_model):
    write_prompts(tmp_path / "in.parquet", n=12)
    job = write_job(tmp_path, tiny_model[0], engine={"quantization": "int8", "quantization_lm_head": True})
    out = plan(job, "--gpu", "L4", "--kv-dtype", "int8", "--json")
    assert out.returncode == 0, out.stderr
    assert [r["weights"] for r in json.loads(out.stdout)["rows"]] == ["int8+head"]
    both = plan(job, "--gpu", "L4", "--kv-dtype", "int8", "--weights", "int8", "--weights", "int8+head",
                "--json")
    rows = json.loads(both.stdout)["rows"]
    assert [r["weights"] for r in rows] == ["int8", "int8+head"]
    table = plan(job, "--gpu", "L4", "--kv-dtype", "int8", "--weights", "int8+head", "--set",
                 "engine.quantization=none")
    assert table.returncode == 0 and "quantization: int8, quantization_lm_head: true}" in table.stdout
    assert rows[1]["weights_gib"] < rows[0]["weights_gib"]   # untied: the head 16 -> 8 bits
