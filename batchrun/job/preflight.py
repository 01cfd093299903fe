"""What can be known about the model before it loads, checked the same way by `submit` (before it claims the
output directory) and `validate`: the model resolves, its architecture is supported, it has safetensors weights
and a tokenizer, the context fits, and the KV pool holds one request at that context."""
from __future__ import annotations

import glob
import math
import os
from dataclasses import dataclass

from batchrun.config import EngineConfig
from batchrun.job.spec import JobSpec
from batchrun.stepmodel.costmodel import ModelSpec


@dataclass
class ModelFacts:
    path: str                 # the resolved model directory
    tokenizer: object
    context: int              # max_model_len as the engine will use it
    kv_bytes_per_token: int   # of the batch lane's KV dtype
    kv_budget: int            # bytes of the batch lane's pool (an estimate on CUDA, where it is profiled)
    kv_sizing: dict           # how the budget is set


def check_model(spec: JobSpec) -> ModelFacts:
    """Raises a JobError naming the field (model, engine.*) for anything that would stop the engine loading."""
    import torch

    from batchrun.engine import kv_cache, kv_sizing
    from batchrun.engine.loader import check_weights, load_config, load_tokenizer, max_model_len, resolve_model_path
    from batchrun.quant.formats import scheme_for
    engine = spec.engine
    config = EngineConfig(model=spec.model, **spec.engine_options)
    try:
        path = resolve_model_path(spec.model)
        hf_config = load_config(path, engine.trust_remote_code)
        check_weights(path)
        tokenizer = load_tokenizer(engine.tokenizer or path, engine.trust_remote_code)
    except (ValueError, OSError) as exc:
        raise spec.fail(("model",), str(exc).removeprefix("model: ")) from exc
    if tokenizer is None:
        raise spec.fail(("model",), f"{path} has no tokenizer files; a job tokenizes its prompts "
                                    "(or set engine.tokenizer)")
    try:
        context = max_model_len(hf_config, config.max_model_len)
    except ValueError as exc:
        raise spec.fail(("engine", "max_model_len"), str(exc).removeprefix("max_model_len: ")) from exc
    on_cpu = config.device == "cpu" or not torch.cuda.is_available()
    try:   # a quantization the engine would refuse, from config.json alone
        scheme_for(hf_config, config.quantization, "cpu" if on_cpu else "cuda", config.quantization_rotation,
                   config.quantization_lm_head)
    except ValueError as exc:
        text = str(exc)
        name = next((n for n in ("quantization_rotation", "quantization_lm_head", "quantization")
                     if text.startswith(f"{n}: ")), None)
        if name is None:
            raise spec.fail(("model",), text.removeprefix("model: ")) from exc
        raise spec.fail(("engine", name), text.removeprefix(f"{name}: ")) from exc
    try:
        shape = ModelSpec.from_config(hf_config, path)   # the planner's reading of layers, KV heads, head size
    except ValueError as exc:
        raise spec.fail(("model",), str(exc).removeprefix("model: ")) from exc
    kv_dtype = kv_cache.storage_dtype(config.kv_cache_dtype, torch.float32 if on_cpu else torch.float16)
    kv_bytes = kv_cache.bytes_per_token(shape.num_layers, shape.kv_heads, shape.head_dim, kv_dtype)
    budget, sizing = _kv_budget(config, path, on_cpu)
    batch_budget, _ = kv_sizing.split_interactive(config, budget)
    try:
        kv_sizing.blocks_for(batch_budget, kv_bytes, config.block_size, context, "kv_cache_memory",
                             config.kv_cache_dtype)
    except ValueError as exc:
        raise spec.fail(("engine", "kv_cache_memory"), str(exc).removeprefix("kv_cache_memory: ")) from exc
    return ModelFacts(path, tokenizer, context, kv_bytes, budget, sizing)


def _kv_budget(config: EngineConfig, model_path: str, on_cpu: bool) -> tuple[int, dict]:
    """The KV pool a run would get: kv_cache_memory, the CPU default, or on CUDA an estimate of the profiled pool
    (device memory x gpu_memory_utilization - weights; the run also subtracts its peak activations and the memory
    of other processes, which only a forward can measure)."""
    import torch

    from batchrun.engine.kv_sizing import DEFAULT_CPU_KV_BYTES
    if config.kv_cache_bytes:
        return config.kv_cache_bytes, {"how": "kv_cache_memory"}
    if on_cpu:
        return DEFAULT_CPU_KV_BYTES, {"how": "CPU default"}
    props = torch.cuda.get_device_properties(torch.device(config.device if config.device != "auto" else "cuda"))
    weights = 2 * _parameter_count(model_path)   # 16-bit weights on CUDA
    return int(props.total_memory * config.gpu_memory_utilization - weights), {
        "how": "profiled at start-up; estimated here as device memory x gpu_memory_utilization - weights",
        "device": props.name, "device_total_bytes": props.total_memory, "weights_bytes": weights}


def _parameter_count(model_path: str) -> int:
    """Parameters in the model's safetensors files, read from their headers (no weight is loaded)."""
    from batchrun.engine.loader import SafetensorsReader
    total = 0
    for path in glob.glob(os.path.join(model_path, "*.safetensors")):
        with open(path, "rb") as f:
            total += sum(math.prod(entry["shape"]) for entry in SafetensorsReader(f).entries.values())
    return total


def model_fingerprint(model: str) -> list:
    """What identifies the weights a job runs: the model as named, and when it is a local directory the size and
    modification time of its config and safetensors files (as the input files are fingerprinted)."""
    if not os.path.isdir(model):
        return [model]
    files = sorted(glob.glob(os.path.join(model, "*.safetensors")) + [os.path.join(model, "config.json")])
    return [os.path.abspath(model)] + [[os.path.basename(f), os.path.getsize(f), os.stat(f).st_mtime_ns]
                                       for f in files if os.path.exists(f)]
