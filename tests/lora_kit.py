"""Tiny base models with LoRA adapters made by PEFT in the test, and PEFT's own greedy tokens as the reference."""
from __future__ import annotations

import copy

import torch
from peft import LoraConfig, get_peft_model

from conftest import reference_greedy, save_tiny_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name: (rank, lora_alpha, use_rslora, targets); ranks up to 64 on a 64-wide model
ADAPTERS = {
    "support": (8, 16, False, ALL),
    "invoices": (64, 32, True, ALL),
    "qv": (4, 8, False, ["q_proj", "v_proj"]),
}


def make_adapter(base, path, seed: int, rank: int, alpha: float, rslora: bool, targets: list[str]):
    """Save a PEFT adapter with random (non-zero) A and B at `path`; returns the PEFT model (unmerged)."""
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=targets,
                        init_lora_weights=False)
    peft_model = get_peft_model(copy.deepcopy(base), config).eval()
    with torch.no_grad():   # PEFT's random init is large for a 64-wide model: keep the outputs near the base's
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.5)
    peft_model.save_pretrained(path)
    return peft_model


def build(tmp_path, model_type: str = "llama", adapters=ADAPTERS, **overrides):
    """(model dir, base transformers model, {name: adapter dir}, {name: PEFT model})."""
    base = save_tiny_model(tmp_path / "base", model_type, seed=1, **overrides)
    paths, peft_models = {}, {}
    for i, (name, spec) in enumerate(adapters.items()):
        paths[name] = str(tmp_path / name)
        peft_models[name] = make_adapter(base, paths[name], 10 + i, *spec)
    return str(tmp_path / "base"), base, paths, peft_models


def peft_greedy(peft_model, prompt: list[int], max_tokens: int, merged: bool = False) -> list[int]:
    model = copy.deepcopy(peft_model).merge_and_unload() if merged else peft_model.get_base_model()
    return reference_greedy(model, prompt, max_tokens)
