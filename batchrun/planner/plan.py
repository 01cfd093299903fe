"""The plan: for each GPU type x KV dtype, KV capacity, predicted makespan (simulated), GPUs for the deadline, cost."""
from __future__ import annotations

import dataclasses
import json
import math

import torch

from batchrun.engine import kv_cache
from batchrun.planner.mixed import LATENCY_KV_DTYPE, MixedPlanner, Traffic, recommend_mixed
from batchrun.planner.workload import Workload
from batchrun.stepmodel.catalog import GPU
from batchrun.stepmodel.costmodel import HEAD_SUFFIX, PLANNED_FORMATS, ModelSpec, RooflineModel, kv_share
from batchrun.stepmodel.simulate import Trace, make_requests, simulate, timeline

KV_DTYPES = ("float16", "bfloat16", "int8", "fp8")
TP_SIZES = (1, 2, 4, 8)   # tensor-parallel ranks per replica tried, smallest first: the GPUs of one node
TP_MIN_SAVING = 0.10
DEFAULT_KV_DTYPES = ("float16", "int8", "fp8")
MAX_GPUS = 4096


def kv_bytes_per_token(model: ModelSpec, dtype: str) -> int:
    """As the engine allocates it: 2 x layers x kv_heads x (head_dim x element bytes + scale bytes)."""
    if dtype not in KV_DTYPES:
        raise ValueError(f"--kv-dtype: unknown value {dtype!r}; allowed: {', '.join(KV_DTYPES)}")
    return kv_cache.bytes_per_token(model.num_layers, model.kv_heads, model.head_dim,
                                    kv_cache.storage_dtype(dtype, torch.float16))


AUTO = "auto"   # engine.quantization auto: fp8 where the GPU has FP8 tensor cores (compute capability 8.9+), else int8


class Planner:
    """`job_weights`: the format the job runs (its engine.quantization, quantization_lm_head) where it quantizes a
    16-bit checkpoint at load, or AUTO (with HEAD_SUFFIX where the head is quantized too): planned by default, and
    the one a recommendation's engine settings change from."""

    def __init__(self, model: ModelSpec, work: Workload, utilization: float = 0.9,
                 deadline_s: float | None = None, cost_options: dict | None = None, adapter_bytes: int = 0,
                 job_weights: str | None = None):
        if not 0 < utilization <= 1:
            raise ValueError(f"--utilization: must be in (0, 1], got {utilization!r}")
        self.model, self.work, self.util, self.deadline = model, work, utilization, deadline_s
        self.job_weights = (job_weights if job_weights and job_weights.startswith(AUTO)
                            else self.with_weights(job_weights).weight_format)
        self.adapter_bytes = adapter_bytes   # the LoRA adapters the engine may hold at once (engine.max_adapters)
        self.cost_options = cost_options or {}
        self._traces: dict[tuple, Trace] = {}
        lengths = [i.prompt_len + i.output_tokens for i in work.items]
        self.longest, self.mean_len = max(lengths), sum(lengths) / len(lengths)
        bs = work.block_size
        # more blocks than every seat at the longest request never changes a schedule: traces are shared above it
        self.block_cap = work.max_num_seqs * -(-self.longest // bs) + 1

    def trace(self, num_blocks: int, shard: int = 1) -> Trace:
        key = (min(num_blocks, self.block_cap), shard)
        if key not in self._traces:
            w = self.work
            self._traces[key] = simulate(w.items[::shard], key[0], w.block_size, w.max_num_seqs,
                                         w.max_num_batched_tokens, w.prefix_caching, w.keys[::shard])
        return self._traces[key]

    def batch_requests(self, shard: int = 1) -> list:
        """Fresh requests of one data-parallel replica's shard (every `shard`-th request), for simulations."""
        return make_requests(self.work.items[::shard], self.work.keys[::shard])

    def kv_bytes_per_token(self, dtype: str) -> int:
        return kv_bytes_per_token(self.model, dtype)

    def activation_bytes(self) -> int:
        return self.model.activation_bytes(self.work.max_num_batched_tokens, self.work.max_num_seqs)

    def with_weights(self, weights: str | None) -> ModelSpec:
        """The model with its projections (and, with HEAD_SUFFIX, its LM head) in this weight format (None: the
        checkpoint's own)."""
        if weights is None or weights == self.model.weight_format:
            return self.model
        if weights not in PLANNED_FORMATS:
            raise ValueError(f"--weights: unknown value {weights!r}; allowed: {', '.join(PLANNED_FORMATS)}")
        return dataclasses.replace(self.model, weights=weights.removesuffix(HEAD_SUFFIX),
                                   quantized_lm_head=weights.endswith(HEAD_SUFFIX))

    def job_format(self, gpu: GPU) -> str:
        """The format the job runs on this GPU type (AUTO resolved as the engine resolves it)."""
        if not self.job_weights.startswith(AUTO):
            return self.job_weights
        return ("fp8" if gpu.fp8_tflops else "int8") + self.job_weights.removeprefix(AUTO)

    def kv_budget(self, gpu: GPU, weights: str | None = None, tp: int = 1) -> int:
        """Bytes left for KV on one GPU: its memory at the utilisation, less its share of the weights (1/tp), the
        activations and the adapters."""
        return (int(gpu.memory_bytes * self.util) - self.with_weights(weights).weight_bytes // tp
                - self.activation_bytes() - self.adapter_bytes)

    def cost_model(self, gpu: GPU, kv_bytes_per_token: int, weights: str | None = None, tp: int = 1
                   ) -> RooflineModel:
        return RooflineModel(self.with_weights(weights), gpu, kv_bytes_per_token, **self.cost_options, tp=tp)

    def tensor_parallel_sizes(self, gpu: GPU, dtype: str, weights: str | None = None) -> list[int]:
        """The ranks per replica (of TP_SIZES) whose GPUs hold the weights and the longest request's KV, among
        those the model's heads and vocabulary split over."""
        m, w = self.model, self.work
        sizes = []
        for tp in TP_SIZES:
            if m.num_heads % tp or (m.kv_heads % tp and tp % m.kv_heads) or m.vocab_size % tp:
                continue
            per_token = self.kv_bytes_per_token(dtype) * kv_share(m.kv_heads, tp)
            if self.kv_budget(gpu, weights, tp) >= -(-self.longest // w.block_size) * w.block_size * per_token:
                sizes.append(tp)
        return sizes

    def row(self, gpu: GPU, dtype: str, weights: str | None = None) -> dict:
        """One GPU type, KV dtype and weight format at the fewest ranks per replica that fit, or more where that
        meets the deadline when fewer do not, or saves TP_MIN_SAVING of the GPU-hours (the all-reduces are priced
        at ideal ring bandwidth: a small predicted gain is not worth the risk); at one rank where no size fits
        (the row says why)."""
        best = None
        for tp in self.tensor_parallel_sizes(gpu, dtype, weights) or [1]:
            row = self.row_at(gpu, dtype, weights, tp)
            if best is None or (row.get("meets_deadline") and not best.get("meets_deadline")) or (
                    row.get("meets_deadline") and row["gpu_hours"] < (1 - TP_MIN_SAVING) * best["gpu_hours"]):
                best = row
        return best

    def row_at(self, gpu: GPU, dtype: str, weights: str | None, tp: int) -> dict:
        """Replicas of `tp` GPUs each (tensor parallel); per-GPU figures (weights, KV budget, bytes per token)."""
        m, w = self.with_weights(weights), self.work
        bpt = int(self.kv_bytes_per_token(dtype) * kv_share(m.kv_heads, tp))
        act, budget = self.activation_bytes(), self.kv_budget(gpu, m.weight_format, tp)
        row = {"gpu": gpu.name, "weights": m.weight_format, "kv_dtype": dtype, "tp": tp, "kv_bytes_per_token": bpt,
               "weights_gib": m.weight_bytes / tp / 2**30, "activations_gib": act / 2**30,
               "adapters_gib": self.adapter_bytes / 2**30, "kv_budget_gib": max(budget, 0) / 2**30,
               "price_per_hour": gpu.price_per_hour}
        if budget <= 0:
            adapters = f" + adapters {self.adapter_bytes / 2**30:.1f} GiB" if self.adapter_bytes else ""
            return row | {"fits": False, "reason": f"weights {m.weight_bytes / 2**30:.1f} GiB + activations "
                          f"{act / 2**30:.1f} GiB{adapters} exceed {self.util:.0%} of {gpu.memory_gb:g} GB, even "
                          f"over {TP_SIZES[-1]} GPUs"}
        blocks = budget // (bpt * w.block_size)
        tokens = blocks * w.block_size
        need = -(-self.longest // w.block_size)
        row |= {"blocks": blocks, "kv_tokens": tokens, "max_concurrency_mix": int(tokens // self.mean_len),
                "max_concurrency_max_context": tokens // m.max_context}
        if blocks < need:
            return row | {"fits": False, "reason": f"the longest request ({self.longest} tokens) needs {need} "
                          f"blocks; the KV budget holds {blocks}"}
        cost = self.cost_model(gpu, bpt, m.weight_format, tp)
        one = timeline(self.trace(blocks), cost.step_time)
        row |= {"fits": True, "decode_step_ms": cost.decode_step(min(w.max_num_seqs, row["max_concurrency_mix"]),
                                                                int(self.mean_len)) * 1e3,
                "prefill_step_ms": cost.prefill_step(w.max_num_batched_tokens) * 1e3,
                "makespan_1gpu_s": one.makespan_s, "drain_s": one.drain_s, "steps": len(one.step_times),
                "preemptions": self.trace(blocks).preemptions, "output_tokens": one.output_tokens}
        replicas, makespan = 1, one.makespan_s
        if self.deadline:
            replicas, makespan = self._gpus_for_deadline(blocks, cost, one.makespan_s)
        gpus = replicas and replicas * tp
        row |= {"gpus": gpus, "replicas": replicas, "makespan_s": makespan}
        if gpus is None:
            return row | {"meets_deadline": False, "reason": f"even {MAX_GPUS} GPUs (or one request alone) "
                          f"take longer than the deadline"}
        hours = gpus * makespan / 3600
        cost_job = hours * gpu.price_per_hour
        return row | {"meets_deadline": self.deadline is None or makespan <= self.deadline, "gpu_hours": hours,
                      "cost_usd": cost_job, "usd_per_million_output_tokens": cost_job / max(one.output_tokens, 1) * 1e6}

    def _gpus_for_deadline(self, blocks: int, cost: RooflineModel, t1: float) -> tuple[int | None, float]:
        """Data-parallel replicas, each running every n-th request; the smallest n whose shard meets it."""
        n, t = 1, t1
        while t > self.deadline:
            if n >= min(MAX_GPUS, len(self.work.items)):
                return None, t
            n = min(max(n + 1, math.ceil(n * t / self.deadline)), MAX_GPUS, len(self.work.items))
            t = timeline(self.trace(blocks, n), cost.step_time).makespan_s
        return n, t

    def plan(self, gpus: list[GPU], kv_dtypes=DEFAULT_KV_DTYPES, traffic: Traffic | None = None,
             weights=()) -> dict:
        """Rows per GPU type x weight format (default: the job's) x KV dtype and a recommendation; with
        interactive traffic also the mixed-SLA layouts (a shared pool with lanes against a latency pool plus a
        throughput pool, at the job's weights), which need the deadline."""
        if traffic and not self.deadline:
            raise ValueError("--deadline: mixed-SLA planning (--interactive-rate) needs the batch job's deadline: "
                             "it is the window both layouts are sized and priced over")
        formats = [self.with_weights(f).weight_format for f in weights]
        job_formats = {g.name: self.job_format(g) for g in gpus}
        rows = [self.row(g, d, f) for g in gpus for f in formats or [job_formats[g.name]] for d in kv_dtypes]
        w = self.work
        report = {"model": {"name": self.model.name, "params": self.model.num_params,
                            "active_params": self.model.active_params, "layers": self.model.num_layers,
                            "kv_heads": self.model.kv_heads, "head_dim": self.model.head_dim,
                            "max_context": self.model.max_context},
                  "job": {"requests": len(w.items), "rows_failing_before_generation": w.rows_failing,
                          "prompt_tokens": sum(i.prompt_len for i in w.items), "output_tokens": w.output_tokens,
                          "longest_request": self.longest, "mean_request": round(self.mean_len, 1)},
                  "settings": {"utilization": self.util, "deadline_s": self.deadline, "block_size": w.block_size,
                               "max_num_seqs": w.max_num_seqs, "max_num_batched_tokens": w.max_num_batched_tokens,
                               "prefix_caching": w.prefix_caching,
                               "weights": formats or sorted(set(job_formats.values())),
                               "checkpoint_weights": self.model.weights, "job_weights": self.job_weights,
                               "data_parallel": True},
                  "rows": rows, "recommendation": recommend(rows, self.deadline, self.model.weights,
                                                            job_formats)}
        if traffic:
            mixed = MixedPlanner(self, traffic, MAX_GPUS)
            mixed_rows = [r for g in gpus for r in mixed.rows(g, [row for row in rows if row["gpu"] == g.name
                                                                     and row["weights"] == job_formats[g.name]])]
            report["mixed"] = {"traffic": traffic.__dict__ | {"latency_kv_dtype": LATENCY_KV_DTYPE},
                               "window_s": self.deadline, "rows": mixed_rows,
                               "recommendation": recommend_mixed(mixed_rows)}
        return report


def recommend(rows: list[dict], deadline: float | None, checkpoint_weights: str = "fp16",
              job_formats: dict[str, str] | None = None) -> dict | None:
    """The cheapest plan that fits (and meets the deadline); ties go to fewer GPUs, then shorter makespan, then the
    job's own weights on that GPU type (job_formats; no settings to change)."""
    def job_format(row: dict) -> str:
        return (job_formats or {}).get(row["gpu"], checkpoint_weights)
    ok = [r for r in rows if r.get("fits") and r.get("meets_deadline")]
    if not ok:
        return None
    ok.sort(key=lambda r: (r["cost_usd"], r["gpus"], r["makespan_s"], r["weights"] != job_format(r)))
    best = ok[0]
    goal = f"meets the {_dur(deadline)} deadline" if deadline else "runs the job"
    reason = (f"cheapest plan that {goal}: {best['gpus']} x {best['gpu']} with {best['weights']} weights and "
              f"{best['kv_dtype']} KV, "
              f"${best['cost_usd']:.4g} per job (${best['usd_per_million_output_tokens']:.4g} per M output tokens), "
              f"makespan {_dur(best['makespan_s'])}")
    other = next((r for r in ok[1:] if r["gpu"] != best["gpu"]), None)
    if other:
        reason += (f"; next: {other['gpus']} x {other['gpu']} {other['weights']} {other['kv_dtype']} at "
                   f"${other['cost_usd']:.4g} (+{(other['cost_usd'] / max(best['cost_usd'], 1e-12) - 1) * 100:.0f}%)")
    return {"gpu": best["gpu"], "weights": best["weights"], "kv_dtype": best["kv_dtype"], "gpus": best["gpus"],
            "reason": reason, "tensor_parallel_size": best.get("tp", 1),
            "executor": executor_stanza(best["gpu"], best.get("replicas", best["gpus"]), best.get("tp", 1)),
            "engine": engine_stanza(best["kv_dtype"], best["weights"], checkpoint_weights, best.get("tp", 1),
                                    job_format(best))}


def engine_stanza(kv_dtype: str, weights: str, checkpoint_weights: str, tp: int = 1,
                  job_weights: str | None = None) -> dict:
    """The job file's engine settings for the plan: a 16-bit checkpoint's weights are quantized at load
    (engine.quantization, and quantization_lm_head for HEAD_SUFFIX; `none` where the job quantizes and the plan
    does not); a checkpoint quantized otherwise is needed as it is published; the ranks per replica where more
    than one."""
    stanza = {"kv_cache_dtype": kv_dtype} | ({"tensor_parallel_size": tp} if tp > 1 else {})
    fmt, head = weights.removesuffix(HEAD_SUFFIX), weights.endswith(HEAD_SUFFIX)
    if weights == (job_weights or checkpoint_weights):
        return stanza
    if checkpoint_weights == "fp16":
        stanza["quantization"] = "none" if fmt == "fp16" else fmt
        if head or (job_weights or "").endswith(HEAD_SUFFIX):
            stanza["quantization_lm_head"] = head
    elif head:
        stanza["model"] = f"a 16-bit checkpoint of the model, quantized at load (this one is {checkpoint_weights})"
    elif weights != checkpoint_weights:
        stanza["model"] = f"a {weights} checkpoint of the model (this one is {checkpoint_weights})"
    return stanza


# catalog names -> Ray's accelerator types (ray.util.accelerators), where they differ
_RAY_ACCELERATORS = {"H100-80GB": "H100", "H200-141GB": "H200", "A100-80GB": "A100-80G", "A100-40GB": "A100-40G"}


def executor_stanza(gpu: str, replicas: int, tp: int = 1) -> dict:
    """The job file's executor section that runs the plan: Ray replicas of `tp` GPUs each (the engine's
    tensor_parallel_size), on that GPU type."""
    return {"kind": "ray", "address": "auto", "replicas": replicas, "gpus_per_replica": tp,
            "accelerator_type": _RAY_ACCELERATORS.get(gpu, gpu)}


def _dur(seconds: float) -> str:
    return f"{seconds:.2f}s" if seconds < 120 else f"{seconds / 60:.1f}m" if seconds < 7200 else f"{seconds / 3600:.2f}h"


def format_table(plan: dict) -> str:
    m, j = plan["model"], plan["job"]
    lines = [f"model {m['name']}: {m['params'] / 1e9:.3f} B params, {m['layers']} layers, {m['kv_heads']} KV heads, "
             f"head_dim {m['head_dim']}, context {m['max_context']}",
             f"job: {j['requests']} requests, {j['prompt_tokens']} prompt + {j['output_tokens']} output tokens, "
             f"mean {j['mean_request']} / longest {j['longest_request']} tokens per request",
             "", f"{'gpu':<11}{'wts':<10}{'kv':<8}{'TP':>3}{'B/tok':>7}{'wts GiB':>8}{'KV GiB':>8}{'blocks':>9}"
             f"{'conc mix':>9}{'conc ctx':>9}{'decode ms':>10}{'prefill ms':>11}{'1-rep h':>9}{'drain s':>9}{'GPUs':>6}"
             f"{'h':>7}{'GPU-h':>8}{'$ job':>9}{'$/M out':>9}"]
    for r in plan["rows"]:
        head = (f"{r['gpu']:<11}{r['weights']:<10}{r['kv_dtype']:<8}{r['tp']:>3}{r['kv_bytes_per_token']:>7}"
                f"{r['weights_gib']:>8.2f}"
                f"{r['kv_budget_gib']:>8.2f}")
        if not r["fits"]:
            lines.append(f"{head}  does not fit: {r['reason']}")
            continue
        lines.append(f"{head}{r['blocks']:>9}{r['max_concurrency_mix']:>9}{r['max_concurrency_max_context']:>9}"
                     f"{r['decode_step_ms']:>10.2f}{r['prefill_step_ms']:>11.2f}{_dur(r['makespan_1gpu_s']):>9}"
                     f"{_dur(r['drain_s']):>9}" + (f"{'-':>6}  {r['reason']}" if r["gpus"] is None else
                     f"{r['gpus']:>6}{_dur(r['makespan_s']):>9}{r['gpu_hours']:>10.3g}{r['cost_usd']:>10.3g}"
                     f"{r['usd_per_million_output_tokens']:>9.4g}"))
    rec = plan["recommendation"]
    lines += ["", f"recommendation: {rec['reason']}" if rec else "recommendation: none of the GPU types fits or "
              "meets the deadline; raise --deadline or add GPU types"]
    if rec:
        stanza, engine = (", ".join(f"{k}: {json.dumps(v) if isinstance(v, bool) else v}" for k, v in part.items())
                          for part in (rec["executor"], rec["engine"]))
        lines.append(f"to run it on Ray, in the job file: executor: {{{stanza}}}  and  engine: {{{engine}}}")
    if "mixed" in plan:
        lines += ["", *format_mixed(plan["mixed"])]
    return "\n".join(lines)


def format_mixed(mixed: dict) -> list[str]:
    t = mixed["traffic"]
    lines = [f"mixed SLA: {t['rate']:g} interactive req/s ({t['prompt_tokens']} prompt + {t['output_tokens']} output "
             f"tokens, p95 TTFT <= {t['ttft_p95_s'] * 1e3:g} ms, p95 TPOT <= {t['tpot_p95_s'] * 1e3:g} ms; latency "
             f"pool {t['latency_kv_dtype']} KV sized for +{t['headroom']:.0%}) with the batch job, every pool held "
             f"for the {_dur(mixed['window_s'])} window",
             f"{'gpu':<11}{'layout':<11}{'batch kv':<9}{'GPUs':>6}{'lat+batch':>10}{'tok/step':>9}{'TTFT p95':>10}"
             f"{'TPOT p95':>10}{'batch done':>11}{'GPU-h':>8}{'$ window':>10}"]
    for r in mixed["rows"]:
        head = f"{r['gpu']:<11}{r['layout']:<11}{r['batch_kv_dtype']:<9}"
        if not r["gpus"]:
            lines.append(f"{head}  cannot: {r['reason']}")
            continue
        split = f"{r['latency_gpus']}+{r['batch_gpus']}" if "latency_gpus" in r else "-"
        lines.append(f"{head}{r['gpus']:>6}{split:>10}{r['max_num_batched_tokens']:>9}{r['ttft_p95_s'] * 1e3:>8.0f}ms"
                     f"{r['tpot_p95_s'] * 1e3:>8.1f}ms"
                     f"{_dur(r['batch_makespan_s']):>11}{r['gpu_hours']:>8.3g}{r['cost_usd']:>10.4g}")
    rec = mixed["recommendation"]
    lines.append(f"mixed recommendation: {rec['reason']}" if rec else
                 "mixed recommendation: no layout meets both the deadline and the latency targets")
    return lines
