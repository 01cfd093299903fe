"""Batch jobs: a YAML spec over Parquet or OpenAI batch JSONL in, resumable Parquet shards out."""
from batchrun.job.api import Job, JobResult
from batchrun.job.errors import EXIT_CODES, JobError
from batchrun.job.spec import JobSpec

__all__ = ["Job", "JobResult", "JobSpec", "JobError", "EXIT_CODES"]
