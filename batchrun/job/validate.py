"""`batchrun validate`: what a job would run, from the spec, the input and the tokenizer; no model is loaded."""
from __future__ import annotations

import glob
import math
import os

from batchrun.config import EngineConfig
from batchrun.engine.kv_sizing import DEFAULT_CPU_KV_BYTES
from batchrun.job import prepare
from batchrun.job.prompts import PromptEncoder
from batchrun.job.report import counts, read_state
from batchrun.job.spec import JobSpec


def _percentile(sorted_values: list[int], q: float) -> int:
    return sorted_values[min(len(sorted_values) - 1, int(q / 100 * len(sorted_values)))] if sorted_values else 0


def _writable(spec: JobSpec) -> str:
    """The output directory, or its nearest existing parent, must be writable (nothing is created)."""
    path = spec.resolve(spec.output.path)
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK):
        raise spec.fail(("output", "path"), f"cannot write to {path} ({probe} is not a writable directory)")
    return path


def _on_cpu(spec: JobSpec) -> bool:
    import torch
    return spec.engine.device == "cpu" or not torch.cuda.is_available()


def _model_facts(spec: JobSpec):
    import torch
    from transformers import AutoConfig, AutoTokenizer
    from batchrun.engine import kv_cache
    from batchrun.engine.loader import resolve_model_path
    engine = spec.engine
    try:
        path = resolve_model_path(spec.model)
        config = AutoConfig.from_pretrained(path, trust_remote_code=engine.trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(engine.tokenizer or path, trust_remote_code=engine.trust_remote_code)
    except (ValueError, OSError) as exc:
        raise spec.fail(("model",), str(exc)) from exc
    context = engine.max_model_len or getattr(config, "max_position_embeddings", 4096)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    compute = torch.float32 if _on_cpu(spec) else torch.float16
    kv_dtype = kv_cache.storage_dtype(engine.kv_cache_dtype, compute)
    return tokenizer, context, kv_cache.bytes_per_token(config.num_hidden_layers, heads, head_dim, kv_dtype), path


def _kv_budget(spec: JobSpec, model_path: str) -> tuple[int, dict]:
    """The KV pool a run would get: kv_cache_memory, the CPU default, or on CUDA an estimate of the profiled pool
    (device memory x gpu_memory_utilization - weights; the run also subtracts its peak activations and the
    memory of other processes, which only a forward can measure)."""
    import torch
    config = EngineConfig(model=spec.model, **spec.engine_options)
    if config.kv_cache_bytes:
        return config.kv_cache_bytes, {"how": "kv_cache_memory"}
    if _on_cpu(spec):
        return DEFAULT_CPU_KV_BYTES, {"how": "CPU default"}
    device = torch.device(spec.engine.device if spec.engine.device != "auto" else "cuda")
    props = torch.cuda.get_device_properties(device)
    weights = 2 * _parameter_count(model_path)   # 16-bit weights on CUDA
    return int(props.total_memory * config.gpu_memory_utilization - weights), {
        "how": "profiled at start-up; estimated here as device memory x gpu_memory_utilization - weights",
        "device": props.name, "device_total_bytes": props.total_memory, "weights_bytes": weights}


def _parameter_count(model_path: str) -> int:
    """Parameters in the model's safetensors files, read from their headers (no weight is loaded)."""
    from safetensors import safe_open
    total = 0
    for path in glob.glob(os.path.join(model_path, "*.safetensors")):
        with safe_open(path, "pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total


def validate(spec: JobSpec) -> dict:
    source = prepare.open_source(spec)
    rows = prepare.count_rows(spec, source)
    out_dir = _writable(spec)
    tokenizer, context, kv_bytes, model_path = _model_facts(spec)
    encoder = PromptEncoder(spec.input, tokenizer, context)
    lengths, totals, errors = [], [], []
    for batch in source.batches():
        encoder.prepare(batch)
        for row in batch:
            if row.error:
                errors.append(f"row {row.index} (id {row.id!r}): {row.error}")
            else:
                lengths.append(len(row.token_ids))
                totals.append(len(row.token_ids) + row.params.max_tokens)
    lengths.sort()
    totals.sort()
    budget, sizing = _kv_budget(spec, model_path)
    report = {"job": spec.path, "model": spec.model, "input_files": len(source.files), "rows": rows,
              "rows_failing_before_generation": len(errors), "first_errors": errors[:5],
              "prompt_tokens": {f"p{q}": _percentile(lengths, q) for q in (50, 90, 99)} | {"max": lengths[-1]
                                                                                         if lengths else 0},
              "context_tokens": context, "kv_bytes_per_token": kv_bytes,
              "kv_per_request_mib": {"p50": round(_percentile(totals, 50) * kv_bytes / 2**20, 2),
                                     "max": round((totals[-1] if totals else 0) * kv_bytes / 2**20, 2)},
              "kv_for_all_max_num_seqs_p90_mib": round(
                  spec.engine.max_num_seqs * _percentile(totals, 90) * kv_bytes / 2**20, 1),
              "kv_cache_memory_mib": round(budget / 2**20, 1), "kv_cache_sizing": sizing,
              "output": out_dir, "output_state": _output_state(spec, source, rows, out_dir)}
    return report


def _output_state(spec: JobSpec, source, rows: int, out_dir: str) -> str:
    if not os.path.isdir(out_dir) or read_state(out_dir) is None:
        return "new"
    changed = prepare.conflict(out_dir, prepare.job_state(spec, source.files, rows))
    if changed:
        return f"submit would refuse: the output holds a different job ({changed}); --restart discards it"
    c = counts(out_dir)
    return f"resume: {c['rows_done']} rows done ({c['rows_failed']} failed), {rows - c['rows_done']} to run"
