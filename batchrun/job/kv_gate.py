"""A job's precision quality gate: before the run, a pilot of the job's own prompts with unquantized KV and
weights and with its 8-bit KV dtype and/or quantized weights; when the gate fails the job stops or falls back to
16-bit KV (the fallback dtype) and float weights, as the spec says. The decision is
saved in the output directory so a resumed job keeps it."""
from __future__ import annotations

import json
import logging

from batchrun.job import prepare
from batchrun.job.errors import EXIT_GATE_FAILED, JobError
from batchrun.job.prompts import PromptEncoder
from batchrun.job.spec import JobSpec
from batchrun.job.storage import Storage, as_storage
from batchrun.kvcheck import KVCheckReport, run_kvcheck

log = logging.getLogger("batchrun.job")
DECISION_FILE = "kv_gate.json"
QUANTIZED = ("int8", "fp8")


def sample(spec: JobSpec, tokenizer, max_model_len: int, n: int) -> tuple[list[list[int]], list]:
    """The first n good rows of the job: (token ids, SamplingParams)."""
    encoder = PromptEncoder(spec.input, tokenizer, max_model_len)
    prompts, params = [], []
    for rows in prepare.open_source(spec).batches(max(n, 64)):
        encoder.prepare(rows)
        for row in rows:
            if not row.error and len(prompts) < n:
                prompts.append(row.token_ids)
                params.append(row.params)
        if len(prompts) >= n:
            break
    return prompts, params


def kvcheck(spec: JobSpec, n: int, kv_cache_dtype: str | None = None, quantization: str | None = None
            ) -> KVCheckReport:
    """Greedy outputs of n job prompts with the job's (or the given) 8-bit KV dtype and weight quantization vs
    unquantized KV and float weights. With neither given nor in the job: int8 KV."""
    from batchrun import LLM
    options = spec.engine_options
    weights = quantization or options.get("quantization") or "none"
    dtype = kv_cache_dtype or options.get("kv_cache_dtype") or ("int8" if weights == "none" else "auto")
    if dtype not in QUANTIZED and weights == "none":
        raise JobError(f"{spec.where('engine', 'kv_cache_dtype')}: kvcheck compares an 8-bit KV dtype "
                       f"({', '.join(QUANTIZED)}) or quantized weights (engine.quantization) against unquantized "
                       f"KV and weights, got KV {dtype!r} and weights 'none'")

    def make_llm(kv_dtype: str, weights: str):   # both sides deterministic: the gate sees the quantization alone
        return LLM(model=spec.model, **{**options, "kv_cache_dtype": kv_dtype, "quantization": weights,
                                        "deterministic": True})

    first = make_llm("auto", "none")   # also gives the tokenizer and context length for encoding the sample
    prompts, params = sample(spec, first.tokenizer, first.engine.max_model_len, n)
    del first
    if not prompts:
        raise JobError(f"{spec.path}: no usable row to sample for the KV check")
    return run_kvcheck(make_llm, prompts, params, dtype, quantization=weights)


def verdict(report: KVCheckReport, gate) -> tuple[bool, str]:
    """(passed, why): identical greedy outputs at least min_identical and, where max_loglik_drop is set, the
    prompts' teacher-forced log-likelihood per token no more than that below the reference's."""
    identical = report.identical_fraction >= gate.min_identical
    reason = (f"{report.identical_fraction:.1%} identical greedy outputs on {report.requests} sample prompts "
              f"{'>=' if identical else '<'} min_identical {gate.min_identical:.1%}")
    if gate.max_loglik_drop is None:
        return identical, reason
    drop = report.loglik_drop
    if drop is None:   # every sample prompt is one token long: nothing to score
        return identical, f"{reason}; no prompt token to score for max_loglik_drop"
    likely = drop <= gate.max_loglik_drop
    return identical and likely, (f"{reason}; prompt log-likelihood drop {drop:+.4f} per token "
                                  f"{'<=' if likely else '>'} max_loglik_drop {gate.max_loglik_drop:g}")


def saved_decision(out_dir: Storage | str) -> dict | None:
    text = as_storage(out_dir).read_text(DECISION_FILE)
    return None if text is None else json.loads(text)


def decide(spec: JobSpec, out_dir: Storage | str) -> dict:
    """Engine options for the run after the gate (unchanged when there is no gate or no 8-bit KV)."""
    options, gate = dict(spec.engine_options), spec.kv_quality_gate
    quantized_weights = options.get("quantization", "none") != "none"
    if not gate.sample or (options.get("kv_cache_dtype") not in QUANTIZED and not quantized_weights):
        return options
    decision = saved_decision(out_dir)
    if decision is None:
        report = kvcheck(spec, gate.sample)
        passed, reason = verdict(report, gate)
        action = "kept" if passed else gate.on_fail
        kept = passed or action == "stop"
        decision = {"report": report.as_dict(), "passed": passed, "action": action, "reason": reason,
                    "kv_cache_dtype": options.get("kv_cache_dtype", "auto") if kept else gate.fallback_dtype,
                    "quantization": options.get("quantization", "none") if kept else "none"}
        as_storage(out_dir).write(DECISION_FILE, json.dumps(decision, indent=2))
    log.info("KV quality gate: %s -> %s (KV %s, weights %s)", decision["reason"], decision["action"],
             decision["kv_cache_dtype"], decision.get("quantization", "none"))
    if decision["action"] == "stop":
        raise JobError(f"{spec.where('kv_quality_gate')}: failed: {decision['reason']}; "
                       f"set on_fail: fallback to run with {gate.fallback_dtype} KV instead", EXIT_GATE_FAILED)
    return {**options, "kv_cache_dtype": decision["kv_cache_dtype"],
            "quantization": decision.get("quantization", options.get("quantization", "none"))}
