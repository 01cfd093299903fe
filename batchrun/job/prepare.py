"""Checks that run before any model loads, shared by `submit` and `validate`."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Iterator

from batchrun.job.errors import JobError
from batchrun.job.openai_batch import OpenAIBatchSource
from batchrun.job.preflight import model_fingerprint
from batchrun.job.prompts import PromptEncoder
from batchrun.job.report import read_state
from batchrun.job.sink import shard_store
from batchrun.job.source import ParquetSource, Row, fingerprint
from batchrun.job.spec import IDENTITY, JobSpec
from batchrun.job.storage import Storage, StorageError

OUTPUT_FILES = ("data", "job.json", "summary.json", "metrics.prom", "job.log", "output.jsonl", "eta_state.json")


def open_source(spec: JobSpec) -> ParquetSource | OpenAIBatchSource:
    if spec.input.format == "openai_batch":
        return OpenAIBatchSource(spec)
    return ParquetSource(spec)


def encoded_rows(spec: JobSpec, tokenizer, context: int, source=None) -> Iterator[Row]:
    """Every input row as the runner would admit it, in input order: its token ids and SamplingParams, or the error
    that fails it before generation. No model is loaded (what `validate` and the planner read of a job)."""
    source = source or open_source(spec)
    encoder = PromptEncoder(spec.input, tokenizer, context)
    for batch in source.batches():
        encoder.prepare(batch)
        yield from batch


def count_rows(spec: JobSpec, source) -> int:
    """Input rows (ids only are read); duplicate ids refuse the job unless input.allow_duplicate_ids, naming the
    file and row (or line) of both copies."""
    seen, again, n = set(), {}, 0
    check = not spec.input.allow_duplicate_ids
    for path, position, value in source.scan_ids():
        n += 1
        if check and value is not None:
            if value in seen and len(again) < 3:
                again.setdefault(value, (path, position))
            seen.add(value)
    if again:
        first = {}
        for path, position, value in source.scan_ids():   # only on this error path: where each first appeared
            if value in again:
                first.setdefault(value, (path, position))
        where = "; ".join(f"{value!r} at {_place(source, *first[value])} and {_place(source, *second)}"
                          for value, second in again.items())
        raise JobError(f"{spec.where('input', 'id_column')}: duplicate ids in the input: {where}; make ids unique "
                       f"or set input.allow_duplicate_ids: true")
    if n == 0:
        raise spec.fail(("input", "path"), "the input has no rows")
    return n


def _place(source, path: str, position: int) -> str:
    unit = "line" if isinstance(source, OpenAIBatchSource) else "row"
    return f"{os.path.basename(path)} {unit} {position}"


def checked_output_storage(spec: JobSpec) -> Storage:
    """The job's output Storage; on a URI proven writable first (credentials found, the bucket there, and a probe
    object written and deleted)."""
    out = spec.output_storage()
    if not out.local:
        try:
            out.check_writable()
        except StorageError as exc:
            raise spec.fail(("output", "path"), str(exc)) from None
    return out


def output_dir(spec: JobSpec) -> Storage:
    """The output directory, created and proven writable; on a URI: credentials found, the bucket there, and a probe
    object written and deleted."""
    out = checked_output_storage(spec)
    if not out.local:
        return out
    path = out.root
    probe = os.path.join(path, f".write-test-{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as exc:
        raise spec.fail(("output", "path"), f"cannot write to {path} ({exc.strerror})") from exc
    return out


def job_state(spec: JobSpec, files: list[str], rows: int) -> dict:
    inputs = [list(f) for f in fingerprint(files, spec.storage.options)]   # as it reads back from job.json
    model = model_fingerprint(spec.model)
    digest = hashlib.sha256(json.dumps([spec.identity(), inputs, model]).encode()).hexdigest()[:16]
    return {"identity": digest, "spec": spec.identity_fields(), "inputs": inputs, "model_files": model,
            "rows": rows, "job_file": os.path.abspath(spec.path)}


def conflict(out_dir: Storage, state: dict) -> str | None:
    """What differs between the job that wrote out_dir and this one, or None when it is the same job."""
    old = read_state(out_dir)
    return None if old is None or old["identity"] == state["identity"] else _diff(old, state)


def claim_output(spec: JobSpec, out_dir: Storage, state: dict, restart: bool) -> None:
    """Refuse a changed spec or input over an existing output unless restart (which clears the old results)."""
    changed = conflict(out_dir, state)
    if changed and not shard_store(out_dir).shards():
        restart = True   # a job that stopped before any result claims nothing: the directory is free
    if changed and not restart:
        raise spec.fail(("output", "path"), f"{out_dir} holds results of a different job ({changed}); undo the "
                                            f"change (e.g. put the old input file back), use another output.path, "
                                            f"or --restart to discard the results")
    if restart:
        for name in OUTPUT_FILES:
            if not out_dir.local:
                if name == "data":
                    out_dir.remove_all(name)
                else:
                    out_dir.remove(name)
                continue
            path = os.path.join(out_dir.root, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)
    if restart or read_state(out_dir) is None:
        out_dir.write("job.json", json.dumps(state, indent=2) + "\n")


def _diff(old: dict, new: dict) -> str:
    changes = []
    for section in IDENTITY:
        a, b = old["spec"].get(section), new["spec"].get(section)
        if isinstance(a, dict) and isinstance(b, dict):
            changes += [f"{section}.{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
                        if a.get(k) != b.get(k)]
        elif a != b:
            changes.append(f"{section}: {a!r} -> {b!r}")
    if not changes:
        before, after = {f[0]: f[1:] for f in old["inputs"]}, {f[0]: f[1:] for f in new["inputs"]}
        for path in sorted(set(before) | set(after)):
            if path not in after:
                changes.append(f"input file {path} is gone")
            elif path not in before:
                changes.append(f"input file {path} is new")
            elif before[path] != after[path]:
                changes.append(f"input file {path} changed (size {before[path][0]} -> {after[path][0]} bytes, "
                               f"or modified since)")
    if not changes and old.get("model_files") != new["model_files"]:
        changes.append(f"the model's files changed ({new['model_files'][0]})")
    return "; ".join(changes[:3]) or "different identity"
