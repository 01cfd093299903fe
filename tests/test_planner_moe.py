"""The planner's parameter counts for mixture-of-experts models: total (memory) and active (FLOPs) against the
parameters transformers builds; a step reads only the experts its tokens are routed to."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from batchrun.stepmodel.catalog import load_catalog
from batchrun.stepmodel.costmodel import ModelSpec, RooflineModel, StepShape
from conftest import tiny_config


def counted(config) -> tuple[int, int]:
    """(total parameters, parameters of one expert) of the transformers model built from `config`."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    return total, 3 * config.hidden_size * (getattr(config, "moe_intermediate_size", None) or config.intermediate_size)


@pytest.mark.parametrize("model_type,overrides,moe_layers", [
    ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2), 2),
    # layer 0 dense (mlp_only_layers), layers 1-3 sparse; Qwen3's q/k norms are 2 x head_dim per layer extra
    ("qwen3_moe", dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       mlp_only_layers=[0]), 3),
])
def test_total_and_active_params(model_type, overrides, moe_layers):
    config = tiny_config(model_type, **overrides)
    spec = ModelSpec.from_config(config)
    total, per_expert = counted(config)
    qk_norms = 2 * spec.head_dim * config.num_hidden_layers if model_type == "qwen3_moe" else 0
    assert spec.moe_layers == moe_layers
    assert spec.num_params + qk_norms == total
    assert spec.active_params + qk_norms == total - moe_layers * (8 - 2) * per_expert


def test_step_reads_only_routed_experts():
    spec = ModelSpec.from_config(tiny_config("mixtral", num_local_experts=8, num_experts_per_tok=2))
    dense = ModelSpec.from_config(tiny_config("llama"))
    embedding = 2 * spec.vocab_size * spec.hidden_size   # untied: looked up, not read whole
    assert not dense.tied_embeddings and dense.active_params == dense.num_params
    assert dense.weight_bytes_read(1) == dense.weight_bytes - 2 * dense.vocab_size * dense.hidden_size
    one, many = spec.weight_bytes_read(1), spec.weight_bytes_read(256)
    assert one < many <= spec.weight_bytes and many == pytest.approx(spec.weight_bytes - embedding, rel=1e-6)
    # batch 1: 2 of 8 experts per layer are read
    assert one == spec.active_params * 2 - embedding
    gpu = next(iter(load_catalog().values()))
    roofline = RooflineModel(spec, gpu, kv_bytes_per_token=0)
    memory_1, compute_1 = roofline.parts(StepShape(1, 1, 0, 0))
    memory_64, _ = roofline.parts(StepShape(64, 64, 0, 0))
    assert memory_1 < memory_64
    # FLOPs: 2 x active params (less the embedding rows, which are looked up) per token, plus the LM head
    lm_head = 2 * spec.vocab_size * spec.hidden_size
    matmul = 2 * (spec.active_params - 2 * spec.vocab_size * spec.hidden_size)
    assert compute_1 == pytest.approx((matmul + lm_head) / (gpu.fp16_tflops * 1e12 * roofline.eff_compute))
