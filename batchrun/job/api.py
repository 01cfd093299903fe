"""Python entry point: `Job.from_yaml(path).run()` returns a JobResult that reads as a pyarrow Table."""
from __future__ import annotations

import os

import pyarrow as pa

from batchrun.job.report import counts, read_state
from batchrun.job.runner import JobRunner
from batchrun.job.sink import JobLock, ShardStore
from batchrun.job.spec import JobSpec


class JobResult:
    def __init__(self, output_dir: str, summary: dict):
        self.output_dir, self.summary = output_dir, summary
        self.exit_code = summary["exit_code"]

    def table(self, input_order: bool = True) -> pa.Table:
        """All result rows (every run of the job), by default in input order."""
        table = ShardStore(self.output_dir).read()
        return table.sort_by("row_index") if input_order else table

    def to_pandas(self, input_order: bool = True):
        return self.table(input_order).to_pandas()

    def __repr__(self) -> str:
        s = self.summary
        return (f"JobResult({self.output_dir!r}, ok={s['rows_ok']}, failed={s['rows_failed']}, "
                f"remaining={s['rows_remaining']}, exit_code={self.exit_code})")


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

    def run(self, restart: bool = False, progress: str = "auto", serve=None) -> JobResult:
        """Run to completion or resume; progress: auto (bar on a terminal), bar, or log. serve: an optional
        llm -> context manager that serves HTTP on the job's engine (batchrun.server.ServeBesideJob)."""
        return JobResult(*JobRunner(self.spec, restart, progress, serve).run())

    def validate(self) -> dict:
        from batchrun.job.validate import validate
        return validate(self.spec)

    def status(self) -> dict:
        """Done, failed and remaining rows from the output directory (nothing is loaded)."""
        out = self.output_dir
        state = read_state(out) if os.path.isdir(out) else None
        if state is None:
            return {"state": "not started", "output": out}
        running = JobLock.held(out)
        c = counts(out)
        return {"state": "running" if running else "done" if c["rows_remaining"] == 0 else "stopped",
                "output": out, "identity": state["identity"], **c}
