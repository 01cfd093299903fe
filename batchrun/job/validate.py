"""`batchrun validate`: what a job would run, from the spec, the input and the tokenizer; no model is loaded."""
from __future__ import annotations

import os

from batchrun.job import preflight, prepare
from batchrun.job.report import counts, read_state
from batchrun.job.spec import JobSpec


def _percentile(sorted_values: list[int], q: float) -> int:
    return sorted_values[min(len(sorted_values) - 1, int(q / 100 * len(sorted_values)))] if sorted_values else 0


def _writable(spec: JobSpec) -> str:
    """The output directory, or its nearest existing parent, must be writable (nothing is created; on a URI a probe
    object is written and deleted)."""
    out = prepare.checked_output_storage(spec)
    if not out.local:
        return out.root
    path = spec.resolve(spec.output.path)
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK):
        raise spec.fail(("output", "path"), f"cannot write to {path} ({probe} is not a writable directory)")
    return path


def validate(spec: JobSpec) -> dict:
    source = prepare.open_source(spec)
    rows = prepare.count_rows(spec, source)
    out_dir = _writable(spec)
    facts = preflight.check_model(spec)
    context, kv_bytes = facts.context, facts.kv_bytes_per_token
    lengths, totals, errors = [], [], []
    for row in prepare.encoded_rows(spec, facts.tokenizer, context, source):
        if row.error:
            errors.append(f"row {row.index} (id {row.id!r}): {row.error}")
        else:
            lengths.append(len(row.token_ids))
            totals.append(len(row.token_ids) + row.params.max_tokens)
    lengths.sort()
    totals.sort()
    report = {"job": spec.path, "model": spec.model, "input_files": len(source.files), "rows": rows,
              "rows_failing_before_generation": len(errors), "first_errors": errors[:5],
              "prompt_tokens": {f"p{q}": _percentile(lengths, q) for q in (50, 90, 99)} | {"max": lengths[-1]
                                                                                         if lengths else 0},
              "context_tokens": context, "kv_bytes_per_token": kv_bytes,
              "kv_per_request_mib": {"p50": round(_percentile(totals, 50) * kv_bytes / 2**20, 2),
                                     "max": round((totals[-1] if totals else 0) * kv_bytes / 2**20, 2)},
              "kv_for_all_max_num_seqs_p90_mib": round(
                  spec.engine.max_num_seqs * _percentile(totals, 90) * kv_bytes / 2**20, 1),
              "kv_cache_memory_mib": round(facts.kv_budget / 2**20, 1), "kv_cache_sizing": facts.kv_sizing,
              "output": out_dir, "output_state": _output_state(spec, source, rows, out_dir)}
    return report


def _output_state(spec: JobSpec, source, rows: int, out_dir: str) -> str:
    out = spec.output_storage()
    if (out.local and not os.path.isdir(out_dir)) or read_state(out) is None:
        return "new"
    changed = prepare.conflict(out, prepare.job_state(spec, source.files, rows))
    if changed:
        return f"submit would refuse: the output holds a different job ({changed}); --restart discards it"
    c = counts(out)
    return f"resume: {c['rows_done']} rows done ({c['rows_failed']} failed), {rows - c['rows_done']} to run"
