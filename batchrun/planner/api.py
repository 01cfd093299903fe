"""`batchrun.plan(job)`: the capacity plan from Python (notebooks), the same as `batchrun plan JOB --json`."""
from __future__ import annotations

from batchrun.deadline import seconds_until
from batchrun.job.spec import JobSpec
from batchrun.planner import plan as planner, workload
from batchrun.stepmodel import catalog as cat
from batchrun.stepmodel.costmodel import HEAD_SUFFIX, ModelSpec


def make_planner(spec: JobSpec, deadline: str | None = None, model_config: str | None = None,
                 utilization: float = 0.9, max_num_seqs: int | None = None) -> planner.Planner:
    model = workload.read_model_config(model_config or spec.model, spec.engine.trust_remote_code,
                                       "--model-config" if model_config else "model")
    work = workload.load_workload(spec, model, max_num_seqs)
    return planner.Planner(model, work, utilization, deadline_seconds(spec, deadline),
                           adapter_bytes=adapter_bytes(spec, model), job_weights=job_weights(spec, model))


# engine.quantization -> the planner's format (W8A16 holds and reads the same bytes as W8A8; auto picks per GPU)
_LOAD_TIME_FORMATS = {"int8": "int8", "int8-w8a16": "int8", "fp8": "fp8", "int4": "int4", "auto": planner.AUTO}


def job_weights(spec: JobSpec, model: ModelSpec) -> str | None:
    """The format the job quantizes a 16-bit checkpoint to at load (None: the checkpoint's own)."""
    fmt = _LOAD_TIME_FORMATS.get(spec.engine.quantization)
    if fmt is None or model.weights != "fp16":
        return None
    return fmt + (HEAD_SUFFIX if spec.engine.quantization_lm_head else "")


def adapter_bytes(spec: JobSpec, model: ModelSpec) -> int:
    """engine.max_adapters of the job's largest adapter, in 16-bit, once, as the engine holds it on a GPU (its
    matrices are views into the stacks the SGMV kernels read): rank x (in + out) per adapted module, B's rows
    those of the whole fused q/k/v or gate/up projection (B is block-diagonal over its parts)."""
    from batchrun.engine.lora.adapter_file import AdapterFile
    from batchrun.models.base import FUSED
    rows = {"qkv_proj": (model.num_heads + 2 * model.kv_heads) * model.head_dim,
            "gate_up_proj": 2 * model.intermediate_size}
    fused_rows = {leaf: rows[joined] for parts, joined in FUSED for leaf in parts}
    sizes = [AdapterFile(name, path).nbytes(2, fused_rows)
             for name, path in (spec.engine_options.get("adapters") or {}).items()]
    return min(spec.engine.max_adapters, len(sizes)) * max(sizes, default=0)


def deadline_seconds(spec: JobSpec, deadline: str | None) -> float | None:
    """Seconds to the deadline: --deadline when given, else the job file's own `deadline:` (None: neither)."""
    if deadline is None and spec.deadline_at is None:
        return None
    try:
        return seconds_until(deadline if deadline is not None else spec.deadline_at)
    except ValueError as exc:
        raise ValueError(f"{'--deadline' if deadline is not None else spec.where('deadline')}: {exc}") from None


def plan(job: str | JobSpec, gpus=(), kv_dtypes=(), deadline: str | None = None, prices: dict | None = None,
         catalog: str | None = None, model_config: str | None = None, utilization: float = 0.9,
         max_num_seqs: int | None = None, overrides=(), weights=()) -> dict:
    """Per GPU type x weight format x KV dtype: KV capacity, predicted makespan, GPUs to meet the deadline,
    GPU-hours and cost, and a recommendation. job: a job file (or a JobSpec); gpus: catalog names (default all);
    kv_dtypes: default float16, int8, fp8; weights: fp16, int8, fp8, int4 (default: the checkpoint's own);
    deadline: '6h', '90m', '07:00' or a date-time (default: the job's own); prices: {gpu: USD per hour}. The
    report's "rows" make a table: pandas.DataFrame(report["rows"])."""
    chosen = cat.select(cat.load_catalog(catalog), list(gpus), prices or {})
    spec = job if isinstance(job, JobSpec) else JobSpec.from_yaml(job, list(overrides))
    return run_plan(make_planner(spec, deadline, model_config, utilization, max_num_seqs), chosen, kv_dtypes,
                    weights=weights)


def run_plan(the_planner: planner.Planner, chosen: list[cat.GPU], kv_dtypes=(), traffic=None, weights=()) -> dict:
    for dtype in kv_dtypes:
        planner.kv_bytes_per_token(the_planner.model, dtype)   # an unknown dtype: a clear error first
    for weight_format in weights:
        the_planner.with_weights(weight_format)
    return the_planner.plan(chosen, tuple(kv_dtypes) or planner.DEFAULT_KV_DTYPES, traffic, tuple(weights))
