"""Python entry point: `Job.from_yaml(path).run()` returns a JobResult that reads as a pyarrow Table."""
from __future__ import annotations

import importlib.util
import os

import pyarrow as pa

from batchrun.job.prepare import open_source
from batchrun.job.report import ESTIMATE_FIELDS, counts, read_json, read_state
from batchrun.job.runner import JobRunner
from batchrun.job.object_lock import ObjectLock
from batchrun.job.sink import JobLock, shard_store
from batchrun.job.spec import JobSpec


class JobResult:
    def __init__(self, output_dir: str, summary: dict, spec: JobSpec | None = None):
        self.output_dir, self.summary, self.spec = output_dir, summary, spec
        self.exit_code = summary["exit_code"]
        self.status = summary.get("status", "done")   # "done", or "interrupted": run the job again to resume

    def table(self, input_order: bool = True, with_input: bool = False) -> pa.Table:
        """All result rows (every run of the job), by default in input order. with_input: the input's columns
        joined on (those the result also has are prefixed 'input_')."""
        out = self.spec.output_storage() if self.spec is not None else self.output_dir
        table = shard_store(out).read()
        if table is None:
            table = pa.table({"row_index": pa.array([], pa.int64())})
        if with_input:
            if self.spec is None:
                raise ValueError("with_input: this result does not know its job; use Job.run()'s result")
            inputs = open_source(self.spec).input_table()
            aligned = inputs.take(table["row_index"])   # row_index is the input position: no join needed
            for name in inputs.column_names:
                if name != "row_index":
                    table = table.append_column(f"input_{name}" if name in table.column_names else name,
                                                aligned[name])
        return table.sort_by("row_index") if input_order else table

    def to_pandas(self, input_order: bool = True, with_input: bool = False):
        """A pandas DataFrame (needs pandas: pip install 'batchrun[notebook]')."""
        if importlib.util.find_spec("pandas") is None:   # pyarrow's own error would not say where it comes from
            raise ImportError("JobResult.to_pandas() needs pandas: pip install 'batchrun[notebook]' (or pandas); "
                              "without it, .table() gives the results as a pyarrow Table")
        return self.table(input_order, with_input).to_pandas()

    def __repr__(self) -> str:
        s = self.summary
        text = (f"JobResult({self.output_dir!r}, status={self.status!r}, ok={s['rows_ok']}, "
                f"failed={s['rows_failed']}, remaining={s['rows_remaining']}, exit_code={self.exit_code})")
        if self.status == "interrupted":
            text += "; finished rows are saved: run the job again (Job.run()) to resume, each row runs once"
        return text


class Job:
    def __init__(self, spec: JobSpec):
        self.spec = spec

    @classmethod
    def from_yaml(cls, path: str, overrides: list[str] = ()) -> "Job":
        """overrides: `section.key=value` strings, as `--set` on the command line."""
        return cls(JobSpec.from_yaml(path, overrides))

    @classmethod
    def from_dict(cls, raw: dict, base_dir: str = ".") -> "Job":
        return cls(JobSpec(raw, base_dir=base_dir))

    @property
    def output_dir(self) -> str:
        return self.spec.resolve(self.spec.output.path)

    def run(self, restart: bool = False, progress: str = "auto", serve=None, executor: str | None = None,
            force: bool = False) -> JobResult:
        """Run to completion or resume; progress: auto (a bar on a terminal or in Jupyter), bar, or log. An interrupt
        (Ctrl-C, a kernel interrupt, SIGTERM) stops admission and saves the finished rows: the result's status is
        then "interrupted", and running again resumes. serve: an optional llm -> context manager that serves HTTP on
        the job's engine (batchrun.server.ServeBesideJob). executor: "local" or "ray" over the job's executor.kind
        (the rest of its executor section applies). force: run on an object store where batchrun cannot take the
        job's lock (no conditional PUT); the caller then makes sure no other submit of the job runs."""
        if executor is not None:
            self.spec.set_executor_kind(executor, "run(executor=...)")
        runner = JobRunner
        if self.spec.executor.kind == "ray":
            from batchrun.job.ray_executor import RayJobRunner as runner
        return JobResult(*runner(self.spec, restart, progress, serve, force).run(), spec=self.spec)

    def validate(self) -> dict:
        from batchrun.job.validate import validate
        return validate(self.spec)

    def status(self) -> dict:
        """Done, failed and remaining rows from the output directory (nothing is loaded; on an object store one
        listing of the shards' manifest entries)."""
        out = self.output_dir
        storage = self.spec.output_storage()
        state = read_state(storage) if not storage.local or os.path.isdir(out) else None
        if state is None:
            return {"state": "not started", "output": out}
        running = JobLock.held(out) if storage.local else ObjectLock.held(storage)
        c = counts(storage)
        status = {"state": "running" if running else "done" if c["rows_remaining"] == 0 else "stopped",
                  "output": out, "identity": state["identity"], **c}
        if running:   # the running job's latest estimate (summary.json is refreshed every output.log_every_s)
            summary = read_json(storage, "summary.json") or {}
            status.update({k: summary.get(k) for k in ESTIMATE_FIELDS if k in summary})
        return status
