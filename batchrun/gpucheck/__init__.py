"""One call on a GPU: `python -m batchrun.gpucheck --json gpu.json` (about 5 minutes on an H200; scripts/gpu_check.sh
runs it with the CUDA tests on a lent machine). Models are built from configs with random weights (models.py).

Sections, in this order:
- kernels: decode attention per KV dtype (float16, int8, fp8) against the copy ceiling and 4.3 TB/s
  (batchrun.gpucheck.kernel_bench);
- identity: the tiny sharp model on the device in float32 with float32, float16, int8 and fp8 KV against a CPU
  float32 run: identical greedy tokens, logprob differences;
- throughput: Llama 3.2 1B's shape, 256 concurrent requests of ~1k-token prompts, per KV dtype: output tok/s, the
  pool sized from the profiled step (and its share of the memory the weights left free), peak memory against the
  device total, the step split (forward, sampler, scheduler, rest), 8-bit capacity and speed against float16;
- peer: transformers' continuous batching (`generate_batch`) on the same model and prompts;
- interactive: interactive-lane time to first token (p50, p95) while the 256-request batch runs;
- throughput_smollm2: SmolLM2-135M's shape, float16 and int8 KV.

`--dry-run` runs every section on the CPU at toy sizes (the kernels under TRITON_INTERPRET): it checks the code
path; its figures are not measurements.
"""


def main(argv: list[str] | None = None) -> dict:
    """Runs the check (batchrun.gpucheck.cli); imported on call, so `python -m batchrun.gpucheck.models` and
    `.summary` load only what they need."""
    from batchrun.gpucheck.cli import main as run
    return run(argv)
