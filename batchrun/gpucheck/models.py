"""The check's models, built from a config with seeded random weights (no download, nothing large to carry):

- `tiny-sharp`: 2 layers, hidden 128, weights drawn 25x wider than usual, seed 5 of 0-7 (the widest smallest
  margin on the identity prompts: 1.1e-3 in the logits, against 1.5e-4 to 7.5e-4 for the others), so that a greedy
  token that differs between two devices in float32 is a bug, not a tie (tests/test_gpucheck_models.py);
- `smollm2-135m`: SmolLM2-135M's shape (30 layers, hidden 576, 9 heads / 3 KV heads, vocabulary 49,152);
- `llama-1b`: Llama 3.2 1B's shape (16 layers, hidden 2048, 32 heads / 8 KV heads, intermediate 8192, vocabulary
  128,256, tied embeddings; plain RoPE).

Every model gets the byte-level BPE tokenizer in tokenizer.json beside this file (259 tokens, trained on a few
sentences: it is tests/conftest.py's `tiny_tokenizer`). Prompts are token ids; generated ids past the tokenizer's
vocabulary decode to nothing.

    python -m batchrun.gpucheck.models --out DIR [--toy]    # one folder per model; --toy: the dry run's sizes
"""
from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import torch

TOKENIZER_FILE = Path(__file__).with_name("tokenizer.json")
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
BOS, EOS = 1, 2

# model name -> (LlamaConfig fields, checkpoint dtype, seed)
SHAPES = {
    "tiny-sharp": (dict(vocab_size=259, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        initializer_range=0.5, tie_word_embeddings=False), torch.float32, 5),
    "smollm2-135m": (dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                          rope_theta=100000.0, tie_word_embeddings=True), torch.bfloat16, 1),
    "llama-1b": (dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                      rope_theta=500000.0, tie_word_embeddings=True), torch.bfloat16, 2),
}
# The dry run's stand-ins: the same families at toy sizes (the tiny model is already small).
TOY = {
    "smollm2-135m": dict(vocab_size=512, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=512),
    "llama-1b": dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
}


def config(name: str, toy: bool = False):
    from transformers import LlamaConfig
    if name not in SHAPES:
        raise ValueError(f"gpucheck model: unknown name {name!r}; known: {', '.join(SHAPES)}")
    fields, dtype, _ = SHAPES[name]
    fields = {**fields, **(TOY.get(name, {}) if toy else {})}
    return LlamaConfig(**fields, bos_token_id=BOS, eos_token_id=EOS, rms_norm_eps=1e-5, dtype=dtype)


def tokenizer():
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER_FILE), unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def draw_weights(model: torch.nn.Module, std: float, seed: int) -> None:
    """Every tensor from one seeded generator in name order (not transformers' own init, whose order may change
    between versions): RMSNorm weights 1, the rest normal(0, std). On the CPU the same seed gives the same model on
    every machine."""
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict(keep_vars=True).items()):
            if name.endswith("norm.weight"):
                tensor.fill_(1.0)
            else:
                tensor.normal_(0.0, std, generator=g)


def build(name: str, out: str | os.PathLike, toy: bool = False, device: str | None = None) -> str:
    """The model's folder under `out` (config, safetensors, tokenizer), built unless a finished one is there.
    Weights are drawn on `device`; by default the tiny model's on the CPU (the same weights everywhere: its margins
    are measured here), the others' on CUDA when available (a 1B model draws in seconds there)."""
    from transformers import AutoModelForCausalLM
    target = Path(out) / (name + ("-toy" if toy else ""))
    if (target / ".complete").exists():
        return str(target)
    cfg = config(name, toy)
    _, dtype, seed = SHAPES[name]
    device = device or ("cuda" if torch.cuda.is_available() and name != "tiny-sharp" else "cpu")
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    draw_weights(model, cfg.initializer_range, seed)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer().save_pretrained(tmp)
    (tmp / ".complete").write_text(f"{name} toy={toy} drawn on {device}\n")
    del model
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return str(target)


def build_all(out: str | os.PathLike, toy: bool = False) -> dict[str, str]:
    return {name: build(name, out, toy) for name in SHAPES}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="one folder per model is made here")
    ap.add_argument("--toy", action="store_true", help="the dry run's toy sizes")
    ap.add_argument("--only", nargs="*", choices=list(SHAPES), help="these models (default: all)")
    args = ap.parse_args(argv)
    for name in args.only or SHAPES:
        print(name, build(name, args.out, args.toy), flush=True)


if __name__ == "__main__":
    main()
