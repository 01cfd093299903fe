"""Mixture-of-experts decode on CPU: batchrun's step time against transformers' forward on the same batch.

    python bench/moe_decode.py [--batch 32] [--prompt 64] [--steps 16] [--hidden 512] [--layers 4]

A Qwen3-MoE-shaped model with random weights (8 experts, top-2, q/k norms), float32 on both sides. batchrun: the
median time of an engine step while all `batch` requests decode (scheduling, the forward over the paged cache,
sampling). transformers: the median time of one forward of the batch's next tokens over its KV cache (greedy
argmax fed back), no generate() overhead. The two alternate step by step. Prints the CPU model and the ratio
(transformers / batchrun).
"""
import argparse
import statistics
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from batchrun import LLM, SamplingParams
from batchrun.cpuinfo import cpu_model


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    config = Qwen3MoeConfig(vocab_size=8192, hidden_size=args.hidden, num_hidden_layers=args.layers,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=64, intermediate_size=4 * args.hidden,
                            moe_intermediate_size=2 * args.hidden, num_experts=8, num_experts_per_tok=2,
                            norm_topk_prob=True, max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    prompts = torch.randint(3, config.vocab_size, (args.batch, args.prompt)).tolist()
    print(f"CPU: {cpu_model()}, torch threads {torch.get_num_threads()}; Qwen3-MoE-shaped: hidden {args.hidden}, "
          f"{args.layers} layers, 8 experts top-2, batch {args.batch}, prompt {args.prompt}, float32")
    with tempfile.TemporaryDirectory() as path:
        model.save_pretrained(path, safe_serialization=True)
        llm = LLM(model=path, dtype="float32", kv_cache_memory="1GiB", max_num_seqs=args.batch,
                  max_num_batched_tokens=max(2048, args.batch * args.prompt))
    ours, theirs = [], []
    with torch.inference_mode():
        steps = batchrun_decode_steps(llm, prompts, args.steps)
        forwards = transformers_decode_steps(model, prompts, args.steps)
        # Alternate the two, step by step, so that a shared machine's load drifts over both alike.
        for _ in range(args.steps):
            ours.append(next(steps))
            theirs.append(next(forwards))
    ours, theirs = statistics.median(ours), statistics.median(theirs)
    print(f"batchrun engine step   median {ours * 1e3:8.2f} ms")
    print(f"transformers forward   median {theirs * 1e3:8.2f} ms")
    print(f"ratio transformers / batchrun: {theirs / ours:.2f}x")


def batchrun_decode_steps(llm, prompts: list[list[int]], steps: int):
    """Yields the time of each engine step in which every request decodes one token."""
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    for prompt in prompts:
        llm.add_request(prompt, params)
    stats = llm.engine.stats
    while True:
        start = time.perf_counter()
        llm.step()
        elapsed = time.perf_counter() - start
        if stats.shape.tokens == stats.shape.seqs == len(prompts):
            yield elapsed


def transformers_decode_steps(model, prompts: list[list[int]], steps: int):
    """Yields the time of each forward of the batch's next tokens over its KV cache (greedy argmax fed back)."""
    out = model(torch.tensor(prompts), use_cache=True)
    while True:
        tokens = out.logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        out = model(tokens, past_key_values=out.past_key_values, use_cache=True)
        yield time.perf_counter() - start


if __name__ == "__main__":
    main()
