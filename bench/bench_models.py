"""The models the throughput benches compare engines on, as local directories both engines load.

    tiny     a random 2-layer Llama (hidden 256, head_dim 64, the smallest vLLM's CPU attention takes): the
             engines' fixed costs, in seconds
    smollm2  SmolLM2-135M-Instruct, the embedded model
    mid      a random ~0.3B Llama (hidden 1024, 16 layers, 16 heads / 4 KV heads, intermediate 4096), where the
             matrix products weigh more than on SmolLM2

The random ones are built once into BATCHRUN_CACHE/bench-models from a config (seed 0, float32 safetensors, tied
embeddings) with SmolLM2's tokenizer, so prompts tokenize the same for every model.
"""
from __future__ import annotations

import os
from pathlib import Path

SHAPES = {
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "mid": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=16,
                num_key_value_heads=4),
}
NAMES = ("tiny", "smollm2", "mid")


def model_path(name: str) -> str:
    """The directory of bench model `name` (one of NAMES), built on first use."""
    from batchrun.engine import loader
    smollm2 = loader.resolve_model_path("smollm2-135m")
    if name == "smollm2":
        return smollm2
    if name not in SHAPES:
        raise ValueError(f"--model: {name!r} is not one of {', '.join(NAMES)}")
    from batchrun.paths import cache_dir
    target = cache_dir() / "bench-models" / name
    if not (target / "config.json").exists():
        _build(name, smollm2, target)
    return str(target)


def _build(name: str, tokenizer_dir: str, target: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=8192, rope_theta=100000.0,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, **SHAPES[name])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, target)   # whole or absent: a killed build leaves only the tmp folder
