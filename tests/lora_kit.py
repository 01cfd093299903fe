"""Tiny base models with LoRA adapters made by PEFT in the test, and PEFT's own greedy tokens as the reference."""
from __future__ import annotations

import copy
import weakref

import torch
from peft import LoraConfig, get_peft_model

from conftest import reference_greedy, save_tiny_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name: PEFT LoraConfig settings; ranks up to 64 on a 64-wide model, rsLoRA, a per-module alpha
ADAPTERS = {
    "support": dict(r=8, lora_alpha=16, target_modules=ALL),
    "invoices": dict(r=64, lora_alpha=32, use_rslora=True, target_modules=ALL),
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], alpha_pattern={"v_proj": 32}),
}


def make_adapter(base, path, seed: int, **settings):
    """Save a PEFT adapter with random (non-zero) A and B at `path`; returns the PEFT model (unmerged)."""
    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, **settings)).eval()
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
        peft_models[name] = make_adapter(base, paths[name], 10 + i, **spec)
    return str(tmp_path / "base"), base, paths, peft_models


_merged: "weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module]" = weakref.WeakKeyDictionary()


def peft_greedy(peft_model, prompt: list[int], max_tokens: int, merged: bool = False) -> list[int]:
    """PEFT's greedy tokens: the LoRA layers applied at run time, or merged into the weights (a copy, once)."""
    if merged and peft_model not in _merged:
        _merged[peft_model] = copy.deepcopy(peft_model).merge_and_unload()
    return reference_greedy(_merged[peft_model] if merged else peft_model.get_base_model(), prompt, max_tokens)
