"""Weights read tensor by tensor from safetensors: the same values as safetensors' own loader, fused as the model
wants them, in the compute dtype; a truncated file or a missing tensor is a clear error."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchrun.engine import loader
from batchrun.models.base import checkpoint_plan


def test_weights_match_safetensors_and_are_fused_and_cast(tiny_model):
    path = tiny_model[0]
    reference = load_file(f"{path}/model.safetensors")
    weights = loader.load_weights(path, torch.device("cpu"), torch.bfloat16,
                                  lambda names: checkpoint_plan(names, tie_embeddings=False))
    q, k, v = (reference[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(weights["model.layers.1.self_attn.qkv_proj.weight"], torch.cat([q, k, v]).bfloat16())
    assert torch.equal(weights["model.norm.weight"], reference["model.norm.weight"].bfloat16())
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    tied = loader.load_weights(path, torch.device("cpu"), torch.float32,
                               lambda names: checkpoint_plan(names, tie_embeddings=True))
    assert tied["lm_head.weight"] is tied["model.embed_tokens.weight"]   # one copy, not two


def test_truncated_file_and_missing_tensor_are_named(tiny_model, tmp_path):
    shutil.copytree(tiny_model[0], tmp_path / "m")
    file = tmp_path / "m" / "model.safetensors"
    tensors = load_file(str(file))
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, str(file))
    plan = lambda names: checkpoint_plan(names, tie_embeddings=False)   # noqa: E731
    with pytest.raises(ValueError, match="has no tensor .model.layers.0.self_attn.k_proj.weight."):
        loader.load_weights(str(tmp_path / "m"), torch.device("cpu"), torch.float32, plan)
    shutil.copy(f"{tiny_model[0]}/model.safetensors", file)
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(ValueError, match="is truncated"):
        loader.load_weights(str(tmp_path / "m"), torch.device("cpu"), torch.float32, plan)
