"""The planner with quantized weights: weight bytes per format, the KV room they leave, decode priced by the bytes
read, the format a checkpoint declares, and the job-file settings the recommendation gives."""
from __future__ import annotations

import dataclasses
import json

import pytest

from batchrun.planner import plan as planner
from batchrun.stepmodel import catalog
from batchrun.stepmodel.costmodel import WEIGHT_FORMATS, ModelSpec, checkpoint_weights
from jobkit import cli, write_job, write_prompts
from test_planner import LLAMA3_8B, LLAMA3_70B, work

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
    # 8-bit from a 16-bit checkpoint is quantized at load; 4-bit needs a 4-bit checkpoint
    assert planner.engine_stanza("int8", "int8", "fp16") == {"kv_cache_dtype": "int8", "quantization": "int8"}
    assert "int4 checkpoint" in planner.engine_stanza("int8", "int4", "fp16")["model"]
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
])
def test_the_checkpoints_own_format(config, expected):
    assert checkpoint_weights(config) == expected
    model = ModelSpec.from_config(dict(LLAMA3_8B, quantization_config=config) if config else LLAMA3_8B)
    assert model.weights == expected


def test_a_format_the_planner_cannot_size_is_named():
    nf4 = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    with pytest.raises(ValueError, match=r"bitsandbytes .*\('m'\); pass --weights"):
        ModelSpec.from_config(dict(LLAMA3_8B, quantization_config=nf4), name="m")
    with pytest.raises(ValueError, match="--weights: unknown value 'int3'"):
        planner.Planner(ModelSpec.from_config(LLAMA3_8B), work()).with_weights("int3")


def test_plan_command_compares_weight_formats(tmp_path, tiny_model):
    write_prompts(tmp_path / "in.parquet", n=12)
    job = write_job(tmp_path, tiny_model[0])
    out = cli("plan", job, "--gpu", "L4", "--kv-dtype", "int8", "--weights", "fp16", "--weights", "int8", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert [r["weights"] for r in report["rows"]] == ["fp16", "int8"]
    assert report["rows"][1]["weights_gib"] < report["rows"][0]["weights_gib"]
    table = cli("plan", job, "--gpu", "L4", "--weights", "int8")
    assert table.returncode == 0 and "int8" in table.stdout and "engine: {kv_cache_dtype:" in table.stdout
    bad = cli("plan", job, "--weights", "int3")
    assert bad.returncode == 2 and "--weights" in bad.stderr
