"""Time the CPU matrix products a quantized linear layer can run on, on SmolLM2's and a 0.3B Llama's shapes, at a
decode step (32 rows) and a prefill chunk (1,024 rows): the numbers batchrun/quant/cpu_kernels.py picks by.

    python bench/quant_kernels.py [--threads 2] [--rows 32 1024]

Candidates per format (the weight [N, K], activations bfloat16 unless said):
  bf16 / fp32    the float path batchrun runs today (oneDNN, pre-packed weight; bf16 on batchrun's AMX kernel
                 where the CPU has AMX)
  w8a16          aten._weight_int8pack_mm (int8 weight, per-channel scale, bf16 activations)
  w8a8-amx       batchrun's AMX kernel, int8 form (kernels/amx_linear.py), activations quantized per token first
  w8a8-onednn    onednn.qlinear_pointwise on a qlinear_prepack'ed weight, activations quantized per token first
  w8a8-intmm     aten._int_mm (int8 x int8 -> int32), activations quantized per token first
  fp8-scaledmm   torch._scaled_mm with e4m3 weight and per-token e4m3 activations
  fp8-dequant    e4m3 weight dequantized to bf16 at every call, then the packed-free F.linear
  int4           aten._weight_int4pack_mm_for_cpu (group 128, 64 where 128 does not divide K)
  int4-widened   the nibbles widened to the activations' dtype at every call, then F.linear (batchrun's int4 path
                 at float32 compute)
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from batchrun.cpuinfo import cpu_flags, cpu_model  # noqa: E402
from batchrun.quant import cpu_kernels, quantize  # noqa: E402

SHAPES = {   # name: [(N, K)] of one layer's projections (fused qkv, o, fused gate_up, down)
    "smollm2-135m": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
    "llama-0.3b": [(3072, 1024), (1024, 1024), (8192, 1024), (1024, 4096)],
}


def timed(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - start) / repeat)
    return best


def candidates(weight: torch.Tensor):
    """name -> a function of x (bf16 [M, K]) for each kernel that runs on this machine."""
    from batchrun.models import cpu_gemm
    q8 = quantize.int8_per_channel(weight)
    f8 = quantize.fp8_per_channel(weight)
    q4 = quantize.int4_grouped(weight)
    out = {}
    for label, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        packed = cpu_gemm.pack(weight.to(dtype))
        if packed is not None:
            out[label] = (dtype, lambda x, p=packed: cpu_gemm.linear(x, p, None))
    for name in cpu_kernels.KERNELS:
        try:
            layer = cpu_kernels.KERNELS[name](q8 if name.startswith("w8") else f8 if name.startswith("fp8") else q4)
            layer(torch.randn(2, weight.shape[1], dtype=torch.bfloat16))
        except (RuntimeError, NotImplementedError) as exc:
            print(f"  {name}: not available here ({str(exc).splitlines()[0][:80]})")
            continue
        out[name] = (torch.bfloat16, layer)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 1024])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx", "avx_vnni", "avx2")))
    print(f"CPU: {cpu_model()}; flags: {' '.join(flags)}; threads {args.threads}; torch {torch.__version__}")
    print(f"load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    torch.manual_seed(0)
    for model, shapes in SHAPES.items():
        layers = [(n, k, candidates(torch.randn(n, k) / k ** 0.5)) for n, k in shapes]
        for rows in args.rows:
            totals: dict[str, float] = {}
            for n, k, kernels in layers:
                for name, (dtype, fn) in kernels.items():
                    x = torch.randn(rows, k).to(dtype)
                    with torch.inference_mode():
                        totals[name] = totals.get(name, 0.0) + timed(lambda: fn(x), 20 if rows <= 64 else 3)
            base = totals.get("bf16")
            cells = [f"{name} {t * 1e3:.2f} ms" + (f" ({base / t:.2f}x bf16)" if base else "")
                     for name, t in totals.items()]
            print(f"{model}, {rows} rows, one layer's four products: " + ", ".join(cells))


if __name__ == "__main__":
    main()
