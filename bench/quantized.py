"""Decode-heavy throughput and memory per weight format, against float32 and bfloat16 weights in the same run.

    python bench/quantized.py [--models smollm2-135m,llama-0.3b] [--formats float32,bfloat16,int8,...]
                              [--requests 32] [--max-tokens 64] [--repeats 3] [--compile]

Each (model, format) runs in a fresh process: RSS before the engine, the peak while loading (ru_maxrss, less
the KV pool) and the weights' bytes as held (packed copies, scales); then `--requests` prompts of 16 tokens
(SmolLM2: the sample articles' first 16; the random model: random ids) decoded greedy for `--max-tokens` tokens
(ignore_eos) after a warm-up, `--repeats` times; output tokens/s of the fastest call (each call's is printed: on a
shared machine a neighbour's burst slows one call), and per CPU second of this process.

The load peak is split: building the model (the loader: the process's peak when it returns over the RSS when it
starts, per weight byte; an upper bound where an earlier peak was higher), before it (config, tokenizer) and after it
(the KV pool's pages as first touched and, with --compile, the warm-up and whole-model compile, which run in
LLM(...): sizes that do not grow with the weights). The headline subtracts the whole KV pool, resident or not.

Formats: float32 / bfloat16 (float weights in that compute dtype),
and engine.quantization values (int8 = W8A8, int8-w8a16, fp8, int4) on bfloat16 compute; `W:none` /
`W:hadamard` sets engine.quantization_rotation (default auto); `W+head` sets engine.quantization_lm_head (the
LM head quantized too, a tied embedding held as int8 rows); `W+kv-int8` / `W+kv-fp8` adds an 8-bit KV cache.
The quality columns are batchrun kvcheck's against the bfloat16 run (identical greedy outputs at full length,
first difference, mean |d logprob| of the chosen tokens before it). llama-0.3b: hidden 1024, intermediate 4096,
16 layers, 16 heads, vocab 32000, tied embeddings, random weights saved once as bfloat16 safetensors. Per-op
path (BATCHRUN_COMPILE=ops) unless --compile.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sample_data", "prompts.parquet")
FORMATS = ("float32", "bfloat16", "int8", "int8-w8a16", "fp8", "int4")
LLAMA_03B = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=16,
                 num_key_value_heads=16, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=True)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(model: str, fmt: str, requests: int, max_tokens: int, repeats: int) -> dict:
    import torch

    import batchrun.engine.engine as engine_module
    from batchrun import LLM, SamplingParams
    torch.manual_seed(0)
    before = rss()
    building = {}
    build_model = engine_module.build_model

    def measured_build(*args, **kwargs):   # the loader's own peak, before the KV pool, warm-up and compile
        building["start"] = rss()
        model = build_model(*args, **kwargs)
        building["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return model
    engine_module.build_model = measured_build
    llm = LLM(model=model, **engine_options(fmt, requests))
    load_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if llm.tokenizer is not None:   # SmolLM2: the sample articles' first 16 tokens
        import pyarrow.parquet as pq
        rows = pq.read_table(SAMPLE).column("prompt").to_pylist()
        prompts = [llm.encode(text)[:16] for text in (rows * requests)[:requests]]
    else:
        prompts = [torch.randint(10, 30000, (16,)).tolist() for _ in range(requests)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=True)
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)   # warm-up
    calls = []   # (wall s, CPU s, outputs) of each timed call; the fastest is reported
    for _ in range(repeats):
        start, cpu = time.perf_counter(), time.process_time()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        calls.append((time.perf_counter() - start, time.process_time() - cpu, outputs))
    wall, cpu, outputs = min(calls, key=lambda call: call[0])
    tokens = sum(len(o.token_ids) for o in outputs)
    weights = weight_bytes(llm.engine.model)
    kv_pool = llm.engine.num_blocks * llm.engine.config.block_size * llm.engine.kv_bytes_per_token
    return dict(model=model, format=fmt, weights_mib=round(weights / 2**20, 1),
                load_peak_over_weights=round((load_peak - before - kv_pool) / weights, 2),
                build_peak_over_weights=round((building["peak"] - building["start"]) / weights, 2),
                before_build_mib=round((building["start"] - before) / 2**20),
                after_build_mib=round((load_peak - building["peak"]) / 2**20),
                peak_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                tok_s=round(tokens / wall, 1), tok_per_cpu_s=round(tokens / cpu, 1),
                tok_s_each=[round(tokens / call[0], 1) for call in calls],
                tokens=[o.token_ids for o in outputs], logprobs=[o.logprobs for o in outputs])


def engine_options(fmt: str, requests: int) -> dict:
    """LLM(...)'s options for a format name (the module docstring's Formats)."""
    weights, _, kv = fmt.partition("+kv-")
    weights, head, _ = weights.partition("+head")
    weights, _, rotation = weights.partition(":")
    return dict(dtype="float32" if weights == "float32" else "bfloat16",
                quantization="none" if weights in ("float32", "bfloat16") else weights,
                quantization_rotation=rotation or "auto", quantization_lm_head=bool(head),
                kv_cache_dtype=kv or "auto", kv_cache_memory="192MiB", max_num_seqs=requests, max_model_len=1024)


def weight_bytes(model) -> int:
    """The model's weights as held: float parameters (a packed Linear's at its dense size: the packed copy is the
    only one), the quantized layers' tensors and an embedding's int8 rows."""
    from batchrun.models.layers import Embedding, Linear
    total = 0
    for module in model.modules():
        if isinstance(module, Embedding) and module.codes is not None:
            total += module.codes.nbytes + module.row_scale.nbytes
        for name, p in module.named_parameters(recurse=False):
            if isinstance(module, Linear) and name == "weight":
                if module.quantized is not None:
                    total += module.quantized.nbytes
                    continue
                if module.packed is not None and p.numel() == 0:
                    total += module.in_features * module.out_features * p.element_size()
                    continue
            total += p.numel() * p.element_size()
    return total


def llama_03b() -> str:
    path = os.path.join(tempfile.gettempdir(), "batchrun-bench-llama-0.3b")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_03B)).to(torch.bfloat16)
        model.save_pretrained(path, safe_serialization=True)   # no tokenizer: the prompts are token ids
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,llama-0.3b")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed generate calls per cell; the fastest counts")
    ap.add_argument("--compile", action="store_true", help="the whole-model graph (compiles in each process)")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats: at least 1")
    if args.child:
        print(json.dumps(child(*args.child, args.requests, args.max_tokens, args.repeats)))
        return
    from batchrun.cpuinfo import cpu_flags, cpu_model
    from batchrun.engine.request import RequestOutput
    from batchrun.kvcheck import compare
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx", "avx_vnni", "avx2")))
    print(f"CPU: {cpu_model()}; flags: {' '.join(flags)}; cores {os.cpu_count()}")
    env = {**os.environ, "BATCHRUN_COMPILE": "1" if args.compile else "ops"}
    for name in args.models.split(","):
        model = llama_03b() if name == "llama-0.3b" else name
        results = {}
        for fmt in args.formats.split(","):
            load = os.getloadavg()[0]
            out = subprocess.run([sys.executable, __file__, "--child", model, fmt, "--requests", str(args.requests),
                                  "--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats)],
                                 env=env, capture_output=True, text=True)
            if out.returncode:
                print(f"{name} {fmt}: failed\n{out.stderr[-2000:]}")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results[fmt] = r
            base = results.get("bfloat16")
            quality = "-"
            if base:
                report = compare(*[[RequestOutput(str(i), 0, t, None, True, "length", logprobs=lp)
                                    for i, (t, lp) in enumerate(zip(x["tokens"], x["logprobs"]))] for x in (base, r)],
                                 "", "bfloat16")
                quality = (f"{report.identical_fraction:.0%} (first difference at "
                           f"{report.mean_first_diff or 0:.1f}, mean |d logprob| {report.mean_abs_logprob_diff:.4f})")
            ratio = f"{r['tok_s'] / base['tok_s']:.2f}x" if base else "-"
            mem = f"{r['weights_mib'] / base['weights_mib']:.2f}x" if base else "-"
            print(f"{name:13s} {fmt:11s} {r['tok_s']:7.1f} tok/s ({ratio} bf16; {r['tok_per_cpu_s']:.1f} tok/cpu-s; "
                  f"calls {r['tok_s_each']}) "
                  f"weights {r['weights_mib']:7.1f} MiB ({mem} bf16), peak RSS {r['peak_rss_mib']:.0f} MiB, "
                  f"load peak (less the KV pool) {r['load_peak_over_weights']:.2f}x the weights (building the "
                  f"model {r['build_peak_over_weights']:.2f}x; before it {r['before_build_mib']} MiB, after it "
                  f"{r['after_build_mib']:+d} MiB), "
                  f"greedy identical to bf16: {quality} "
                  f"(load avg {load:.1f})", flush=True)


if __name__ == "__main__":
    main()
