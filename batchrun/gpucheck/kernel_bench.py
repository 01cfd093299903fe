"""GPU measurement of the paged-attention kernels, in one run:

1. the bandwidth ceiling: a large device-to-device copy, bytes read + written per second;
2. decode attention (default: batch 64, context 4,096, head_dim 128, 8 KV heads, GQA 4) for float16, int8 and fp8
   KV: median time over CUDA events after warm-up, bytes of K/V and scales read, achieved bandwidth and its
   fraction of the copy ceiling, the torch reference's time; checked against the reference first;
3. end to end: the engine on SmolLM2 vs transformers `generate` with static batches (output tokens/s, ratio).

    python -m batchrun.gpucheck.kernel_bench [--json out.json] [--skip-e2e]
    python -m batchrun.gpucheck.kernel_bench --dry-run    # small shapes, no timing; without CUDA under TRITON_INTERPRET

Goals (issue 5, H200): >= 70% of copy bandwidth for all three dtypes; int8 and fp8 >= 1.6x faster than float16.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch

KV_NAMES = ("float16", "int8", "fp8")
# (BLOCK_N, num_warps, num_stages) tried per dtype; the fastest is reported
DECODE_CONFIGS = ((64, 4, 2), (128, 4, 2), (64, 8, 3), (128, 8, 3), (32, 4, 3))
GOAL_FRACTION, GOAL_SPEEDUP = 0.70, 1.6


@dataclass
class DecodeShape:
    batch: int = 64
    context: int = 4096
    head_dim: int = 128
    kv_heads: int = 8
    gqa: int = 4
    block_size: int = 16

    @property
    def heads(self) -> int:
        return self.kv_heads * self.gqa

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.context // self.block_size)


DRY_RUN_SHAPE = DecodeShape(batch=3, context=100, head_dim=64, kv_heads=2, gqa=4, block_size=16)


def kv_dtype(name: str) -> torch.dtype:
    from batchrun.kernels import quant
    return torch.float16 if name == "float16" else quant.storage_dtype(name)


def kv_bytes_read(shape: DecodeShape, name: str) -> int:
    """Bytes of K and V (and their float32 per-token-per-head scales when 8-bit) that one decode step reads."""
    element = 2 if name == "float16" else 1
    scale = 0 if name == "float16" else 4
    return 2 * shape.batch * shape.context * shape.kv_heads * (shape.head_dim * element + scale)


def make_decode_inputs(shape: DecodeShape, name: str, device: torch.device, seed: int = 0):
    """Random pool (quantized when 8-bit) with every request's blocks at random places; full contexts."""
    from batchrun.kernels import quant
    g = torch.Generator(device=device).manual_seed(seed)
    num_blocks = shape.batch * shape.blocks_per_seq + 1
    dims = (num_blocks, shape.block_size, shape.kv_heads, shape.head_dim)
    caches = []
    for _ in range(2):
        x = torch.randn(dims, generator=g, device=device, dtype=torch.float16)
        caches.append(quant.quantize(x, kv_dtype(name)) if name != "float16" else (x, None))
    (k, k_scale), (v, v_scale) = caches
    tables = torch.randperm(num_blocks - 1, generator=g, device=device)[:shape.batch * shape.blocks_per_seq]
    tables = tables.view(shape.batch, shape.blocks_per_seq).to(torch.int32)
    lens = torch.full((shape.batch,), shape.context, dtype=torch.int32, device=device)
    query = torch.randn(shape.batch, shape.heads, shape.head_dim, generator=g, device=device, dtype=torch.float16)
    return query, k, v, k_scale, v_scale, tables, lens


def cuda_median_ms(fn, warmup: int = 10, reps: int = 50) -> float:
    """Median of `reps` CUDA-event timings of fn() after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def wall_ms(fn, warmup: int = 0, reps: int = 1) -> float:
    """Dry-run stand-in for cuda_median_ms: one wall-clock call (the interpreter's time, not a measurement)."""
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, timer=cuda_median_ms) -> float:
    """Bytes read + written per second by a device-to-device copy of nbytes."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src), warmup=5, reps=20)
    return 2 * nbytes / (ms / 1e3)


def bench_decode(shape: DecodeShape, name: str, device: torch.device, ceiling: float, timer=cuda_median_ms,
                 configs=DECODE_CONFIGS) -> dict:
    """One dtype's row: accuracy vs the reference, then the best config's time and bandwidth."""
    from batchrun.kernels import paged_attention, reference
    query, k, v, k_scale, v_scale, tables, lens = make_decode_inputs(shape, name, device)
    scale = shape.head_dim ** -0.5
    ref = reference.paged_decode_attention(query.float(), k, v, tables, lens, scale, k_scale, v_scale, shape.context)
    out = paged_attention.paged_decode_attention(query, k, v, tables, lens, scale, k_scale, v_scale,
                                                 max_len=shape.context)
    row = dict(kv_dtype=name, bytes_read=kv_bytes_read(shape, name),
               rel_err=((out.float() - ref).norm() / ref.norm()).item(),
               num_splits=paged_attention.choose_num_splits(shape.batch, shape.kv_heads, shape.context,
                                                            paged_attention._num_sms(device)))
    timings = {}
    for block_n, warps, stages in configs:
        timings[(block_n, warps, stages)] = timer(lambda: paged_attention.paged_decode_attention(
            query, k, v, tables, lens, scale, k_scale, v_scale, max_len=shape.context, out=out, block_n=block_n,
            num_warps=warps, num_stages=stages))
    best = min(timings, key=timings.get)
    ms = timings[best]
    torch_ms = timer(lambda: reference.paged_decode_attention(query, k, v, tables, lens, scale, k_scale,
                                                                       v_scale, shape.context), warmup=3, reps=10)
    row.update(ms=ms, config=dict(block_n=best[0], num_warps=best[1], num_stages=best[2]),
               all_configs_ms={str(c): t for c, t in timings.items()}, gbps=row["bytes_read"] / (ms / 1e3) / 1e9,
               torch_ms=torch_ms, vs_torch=torch_ms / ms)
    row["frac_of_copy"] = row["gbps"] * 1e9 / ceiling
    return row


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def e2e(model: str, num_prompts: int, max_tokens: int, batch_size: int, kv_cache_dtype: str,
        kv_cache_memory: str | None = None) -> dict:
    """Engine on the Triton backend vs transformers generate (static batches, left padded): same prompts, greedy,
    exactly max_tokens each, output tokens per second."""
    from transformers import AutoModelForCausalLM
    from batchrun import LLM, SamplingParams
    llm = LLM(model=model, kv_cache_dtype=kv_cache_dtype, attention_backend="triton", kv_cache_memory=kv_cache_memory)
    device, tok = llm.engine.device, llm.engine.tokenizer
    prompts = [f"Question {i}: explain in detail why the number {i * 7 + 3} is interesting." for i in range(num_prompts)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)   # warm-up: compile the kernels
    _sync(device)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    _sync(device)
    engine_s = time.perf_counter() - t
    engine_tokens = sum(len(o.token_ids) for o in outs)
    dtype, path = llm.engine.dtype, llm.engine.model_path
    del llm, outs
    if device.type == "cuda":
        torch.cuda.empty_cache()

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    pad = tok.pad_token_id
    with torch.inference_mode():
        hf.generate(**tok(prompts[:2], return_tensors="pt", padding=True).to(device), max_new_tokens=2,
                    pad_token_id=pad)
        _sync(device)
        t, hf_tokens = time.perf_counter(), 0
        for i in range(0, num_prompts, batch_size):
            enc = tok(prompts[i:i + batch_size], return_tensors="pt", padding=True).to(device)
            out = hf.generate(**enc, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                              pad_token_id=pad)
            hf_tokens += (out.shape[1] - enc.input_ids.shape[1]) * out.shape[0]
        _sync(device)
        hf_s = time.perf_counter() - t
    return dict(kv_cache_dtype=kv_cache_dtype, dtype=str(dtype), prompts=num_prompts, max_tokens=max_tokens,
                engine_tokens=engine_tokens, engine_tok_s=engine_tokens / engine_s, hf_tokens=hf_tokens,
                hf_tok_s=hf_tokens / hf_s, hf_batch_size=batch_size, ratio=(engine_tokens / engine_s) / (hf_tokens / hf_s))


def print_decode_table(shape: DecodeShape, rows: list[dict], ceiling: float) -> None:
    print(f"decode: batch {shape.batch}, context {shape.context}, head_dim {shape.head_dim}, "
          f"{shape.kv_heads} KV heads, GQA {shape.gqa}, block {shape.block_size}")
    print(f"copy ceiling: {ceiling / 1e9:.0f} GB/s (read + write)")
    print(f"{'kv':>8} {'MB read':>9} {'rel err':>9} {'ms':>8} {'GB/s':>7} {'% copy':>7} {'vs fp16':>8} "
          f"{'torch ms':>9} {'config':>12}")
    base = rows[0]["ms"]
    for r in rows:
        print(f"{r['kv_dtype']:>8} {r['bytes_read'] / 1e6:9.1f} {r['rel_err']:9.2e} {r['ms']:8.3f} {r['gbps']:7.0f} "
              f"{100 * r['frac_of_copy']:6.1f}% {base / r['ms']:7.2f}x {r['torch_ms']:9.3f} "
              f"{str(tuple(r['config'].values())):>12}")
    ok_bw = all(r["frac_of_copy"] >= GOAL_FRACTION for r in rows)
    ok_speed = all(base / r["ms"] >= GOAL_SPEEDUP for r in rows[1:])
    print(f"goal >= {GOAL_FRACTION:.0%} of copy: {'met' if ok_bw else 'NOT met'}; "
          f"8-bit >= {GOAL_SPEEDUP}x float16: {'met' if ok_speed else 'NOT met'}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="small shapes on CPU (kernels under TRITON_INTERPRET), wall-clock times of the interpreter; "
                         "end to end only with --model")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--model", help="model for the end-to-end run (default smollm2-135m on CUDA)")
    ap.add_argument("--kv-cache-memory", help="engine KV pool for the end-to-end run (default: profiled on CUDA)")
    ap.add_argument("--e2e-prompts", type=int, default=256)
    ap.add_argument("--e2e-max-tokens", type=int, default=128)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    if args.dry_run:
        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"   # before the kernels are first imported (and decorated)
        # on a CUDA machine the interpreter is off: the small shapes run there
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        shape, timer, configs = DRY_RUN_SHAPE, wall_ms, DECODE_CONFIGS[:2]
        ceiling = copy_bandwidth(device, 64 << 20, timer)
        model = None if args.skip_e2e else args.model
    else:
        if not torch.cuda.is_available():
            raise SystemExit("batchrun/gpucheck/kernel_bench.py measures on a CUDA GPU and none is visible here; "
                             "run it on a GPU machine, or use --dry-run to check its shapes and byte counts")
        device, shape, timer, configs = torch.device("cuda"), DecodeShape(), cuda_median_ms, DECODE_CONFIGS
        ceiling = copy_bandwidth(device)
        model = None if args.skip_e2e else args.model or "smollm2-135m"
    rows = [bench_decode(shape, name, device, ceiling, timer, configs) for name in KV_NAMES]
    if args.dry_run:
        print(f"DRY RUN: small shapes on {device.type}, wall-clock times (the interpreter's on CPU), not measurements")
    print_decode_table(shape, rows, ceiling)
    result = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)",
                  shape=asdict(shape), copy_gbps=ceiling / 1e9, decode=rows, e2e=[])
    for kv in ("auto", "int8") if model else ():
        r = e2e(model, args.e2e_prompts, args.e2e_max_tokens, args.hf_batch_size, kv, args.kv_cache_memory)
        result["e2e"].append(r)
        print(f"e2e {model} kv {kv} ({r['dtype']}): engine {r['engine_tok_s']:.1f} tok/s, transformers generate "
              f"(static batch {r['hf_batch_size']}) {r['hf_tok_s']:.1f} tok/s, ratio {r['ratio']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
