"""What a job has done, from its output directory (a local path or a URI's Storage): counts for `status`,
summary.json, a Prometheus textfile."""
from __future__ import annotations

import json
import logging
import time

from prometheus_client import CollectorRegistry, Gauge, generate_latest, write_to_textfile

from batchrun.job.object_shards import shard_counts
from batchrun.job.sink import ShardStore, shard_store
from batchrun.job.storage import Storage, as_storage

log = logging.getLogger("batchrun.job")
ETA_STATE = "eta_state.json"
ESTIMATE_FIELDS = ("eta_seconds", "eta_seconds_p10", "eta_seconds_p90", "predicted_finish", "predicted_finish_timestamp",
                   "expected_output_tokens_left", "deadline", "on_track", "deadline_verdict", "output_tokens_per_s")


def read_state(out_dir: Storage | str) -> dict | None:
    text = as_storage(out_dir).read_text("job.json")
    return None if text is None else json.loads(text)


def counts(out_dir: Storage | str) -> dict:
    """Rows done (ok / failed), tokens in and out, remaining, read from the committed shards (on an object store
    from one listing of their manifest entries)."""
    state = read_state(out_dir) or {}
    total = state.get("rows")
    store = shard_store(out_dir)
    if not isinstance(store, ShardStore):
        c = store.counts()
        c["rows_total"] = total
        c["rows_remaining"] = None if total is None else total - c["rows_done"]
        return c
    table = store.read(["status", "prompt_tokens", "completion_tokens", "row_index"])
    rows, failed, prompt, completion = (0, 0, 0, 0) if table is None else shard_counts(table)
    c = {"rows_done": rows, "rows_ok": rows - failed, "rows_failed": failed, "prompt_tokens": prompt,
         "completion_tokens": completion}
    c["rows_total"] = total
    c["rows_remaining"] = None if total is None else total - c["rows_done"]
    return c


def read_json(out_dir: Storage | str, name: str) -> dict | None:
    """A JSON file the job writes (summary.json, eta_state.json); None when missing or unreadable."""
    try:
        text = as_storage(out_dir).read_text(name)
        return None if text is None else json.loads(text)
    except (OSError, ValueError):
        return None


def write_eta_state(out_dir: Storage | str, state: dict) -> None:
    try:
        as_storage(out_dir).write(ETA_STATE, json.dumps(state) + "\n")
    except OSError as exc:
        log.error("cannot write %s in %s (%s)", ETA_STATE, out_dir, exc.strerror or exc)


def write_summary(out_dir: Storage | str, name: str, run: dict) -> dict:
    """summary.json (totals over all runs plus this run's speed and KV figures) and metrics.prom."""
    out = as_storage(out_dir)
    summary = {"job": name, **counts(out), **run, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        out.write("summary.json", json.dumps(summary, indent=2) + "\n")
        if out.local:
            write_metrics(out.join("metrics.prom"), summary)
        else:
            out.write("metrics.prom", generate_latest(metrics_registry(summary)))
    except OSError as exc:   # disk full or read-only: the results are safe in their shards; say so and go on
        log.error("cannot write summary.json / metrics.prom in %s (%s)", out_dir, exc.strerror or exc)
    return summary


def write_metrics(path: str, s: dict) -> None:
    """Textfile-collector format, written atomically (node_exporter reads *.prom: copy or link it there)."""
    write_to_textfile(path, metrics_registry(s))


def metrics_registry(s: dict) -> CollectorRegistry:
    registry = CollectorRegistry()
    metrics = [
        ("batchrun_job_rows", "Rows in the output by status.",
         [({"status": "ok"}, s["rows_ok"]), ({"status": "error"}, s["rows_failed"])]),
        ("batchrun_job_rows_remaining", "Input rows not yet in the output.", [({}, s["rows_remaining"])]),
        ("batchrun_job_prompt_tokens", "Prompt tokens of all output rows.", [({}, s["prompt_tokens"])]),
        ("batchrun_job_completion_tokens", "Generated tokens of all output rows.", [({}, s["completion_tokens"])]),
        ("batchrun_job_run_wall_seconds", "Wall time of the last run.", [({}, s["wall_s"])]),
        ("batchrun_job_run_output_tokens_per_second", "Generated tokens per second in the last run.",
         [({}, s["output_tokens_per_s"])]),
        ("batchrun_job_run_preemptions", "KV preemptions in the last run.", [({}, s["preemptions"])]),
        ("batchrun_job_run_kv_blocks_peak", "Most KV blocks in use at once in the last run.",
         [({}, s["kv_blocks_peak"])]),
        ("batchrun_job_exit_code", "Exit code of the last run (see batchrun submit --help); NaN while running.",
         [({}, s["exit_code"])]),
        ("batchrun_job_eta_seconds", "Predicted seconds until the job is done (0 when done; NaN when not known).",
         [({}, s.get("eta_seconds"))]),
        ("batchrun_job_eta_seconds_p10", "The early end (p10) of the band around eta_seconds.",
         [({}, s.get("eta_seconds_p10"))]),
        ("batchrun_job_eta_seconds_p90", "The late end (p90) of the band around eta_seconds.",
         [({}, s.get("eta_seconds_p90"))]),
        ("batchrun_job_predicted_finish_timestamp", "Predicted finish time, Unix seconds (NaN when not known).",
         [({}, s.get("predicted_finish_timestamp"))]),
        ("batchrun_job_on_track", "1 when the predicted finish is before the job's deadline, else 0 (NaN without "
                                  "a deadline or an estimate).", [({}, s.get("on_track"))]),
        ("batchrun_job_last_run_timestamp_seconds", "When this was written: the last run's end, or its last report "
                                                    "while it runs.", [({}, time.time())]),
    ]
    for name, help_text, samples in metrics:
        gauge = Gauge(name, help_text, ["job", *samples[0][0]], registry=registry)
        for labels, value in samples:
            gauge.labels(job=s["job"], **labels).set(float("nan") if value is None else value)
    return registry
