"""The models the throughput benches compare engines on, as local directories both engines load.

    tiny     a random 2-layer Llama (hidden 256, head_dim 64, the smallest vLLM's CPU attention takes): the
             engines' fixed costs, in seconds
    smollm2  SmolLM2-135M-Instruct, the embedded model
    mid      a random ~0.3B Llama (hidden 1024, 16 layers, 16 heads / 4 KV heads, intermediate 4096), where the
             matrix products weigh more than on SmolLM2
    smollm2-w8a8, mid-w8a8
             the same, saved as a compressed-tensors INT8 W8A8 checkpoint as llm-compressor writes one: each
             decoder projection's weight int8 with a per-output-channel scale (absmax / 127, no calibration),
             activations quantized per token at run time; embeddings and the tied LM head stay as they were

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
NAMES = ("tiny", "smollm2", "mid", "smollm2-w8a8", "mid-w8a8")
W8A8 = {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"], "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True,
                                  "dynamic": True}}}}


def model_path(name: str) -> str:
    """The directory of bench model `name` (one of NAMES), built on first use."""
    from batchrun.engine import loader
    smollm2 = loader.resolve_model_path("smollm2-135m")
    if name == "smollm2":
        return smollm2
    if name not in NAMES:
        raise ValueError(f"--model: {name!r} is not one of {', '.join(NAMES)}")
    from batchrun.paths import cache_dir
    target = cache_dir() / "bench-models" / name
    if not (target / "config.json").exists():
        if name.endswith("-w8a8"):
            _quantize_w8a8(model_path(name.removesuffix("-w8a8")), target)
        else:
            _build(name, smollm2, target)
    return str(target)


def _quantize_w8a8(source: str, target: Path) -> None:
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True)
    state = {}
    for path in sorted(Path(source).glob("*.safetensors")):
        state.update(load_file(path))
    for name in [n for n in state if n.startswith("model.layers.") and n.endswith("_proj.weight")]:
        weight = state[name].float()
        scale = weight.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
        state[name] = torch.round(weight / scale).clamp_(-127, 127).to(torch.int8)
        state[name.removesuffix("weight") + "weight_scale"] = scale.to(torch.bfloat16)
    save_file(state, str(tmp / "model.safetensors"))
    for path in Path(source).iterdir():
        if path.is_file() and path.suffix != ".safetensors" and not path.name.endswith(".index.json"):
            shutil.copy(path, tmp / path.name)
    config = json.loads((tmp / "config.json").read_text())
    (tmp / "config.json").write_text(json.dumps({**config, "quantization_config": W8A8}, indent=2))
    os.replace(tmp, target)


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
