"""Results as Parquet shards in OUT/data: each written to a hidden temporary name, fsynced, then renamed.

The renamed shards are the checkpoint: a row is done exactly when it is in one, so a kill at any moment loses
only rows not yet in a shard (they run again) and never duplicates one. Readers skip the hidden temporaries.
"""
from __future__ import annotations

import fcntl
import glob
import os
import re
import time

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.job.errors import EXIT_LOCKED, JobError

_PART = re.compile(r"(part|sorted)-(\d{6})\.parquet$")


def result_schema(id_type: pa.DataType, passthrough: list[pa.Field]) -> pa.Schema:
    return pa.schema([pa.field("id", id_type), ("text", pa.string()), ("finish_reason", pa.string()),
                      ("prompt_tokens", pa.int32()), ("completion_tokens", pa.int32()), ("status", pa.string()),
                      ("error", pa.string()), ("latency", pa.float64()), ("time_to_first_token", pa.float64()),
                      ("cached_tokens", pa.int32()), ("row_index", pa.int64()), *passthrough])


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ShardStore:
    """The shards of one output directory: list, read, finish an interrupted compaction."""

    def __init__(self, out_dir: str):
        self.dir = os.path.join(out_dir, "data")

    def _files(self) -> list[tuple[str, int, str]]:
        found = []
        for path in glob.glob(os.path.join(self.dir, "*.parquet")):
            m = _PART.search(path)
            if m:
                found.append((m.group(1), int(m.group(2)), path))
        return sorted(found, key=lambda s: (s[1], s[0]))

    def shards(self) -> list[tuple[str, int, str]]:
        """(kind, number, path) of the live shards; those already merged into a sorted file are left out."""
        files = self._files()
        merged = max((seq for kind, seq, _ in files if kind == "sorted"), default=-1)
        return [f for f in files if f[1] > merged or (f[1] == merged and f[0] == "sorted")]

    def repair(self) -> None:
        """Delete temporaries of a killed writer and shards merged into a sorted file by a killed run."""
        live = self.shards()
        for path in glob.glob(os.path.join(self.dir, ".*.tmp")):
            os.remove(path)
        for f in self._files():
            if f not in live:
                os.remove(f[2])

    def read(self, columns: list[str] | None = None) -> pa.Table | None:
        paths = [p for _, _, p in self.shards()]
        if not paths:
            return None
        return pa.concat_tables([pq.read_table(p, columns=columns) for p in paths], promote_options="default")

    def done_indices(self) -> set[int]:
        table = self.read(["row_index"])
        return set() if table is None else set(table.column(0).to_pylist())


class ResultSink:
    def __init__(self, out_dir: str, schema: pa.Schema, shard_rows: int, flush_every_s: float):
        self.store = ShardStore(out_dir)
        os.makedirs(self.store.dir, exist_ok=True)
        self.store.repair()
        self.schema, self.shard_rows, self.flush_every_s = schema, shard_rows, flush_every_s
        self.seq = max((seq for _, seq, _ in self.store.shards()), default=0) + 1
        self.pending: list[dict] = []
        self.last_flush = time.monotonic()
        self.rows_written = 0

    def add(self, record: dict) -> None:
        self.pending.append(record)
        if len(self.pending) >= self.shard_rows or time.monotonic() - self.last_flush >= self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        self.last_flush = time.monotonic()
        if not self.pending:
            return
        self._write(pa.Table.from_pylist(self.pending, schema=self.schema), "part")
        self.rows_written += len(self.pending)
        self.pending = []

    def _write(self, table: pa.Table, kind: str, seq: int | None = None) -> None:
        name = f"{kind}-{seq or self.seq:06d}.parquet"
        tmp = os.path.join(self.store.dir, f".{name}.tmp")
        with open(tmp, "wb") as f:
            pq.write_table(table, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.store.dir, name))
        _fsync_dir(self.store.dir)
        self.seq = max(self.seq, seq or self.seq) + 1

    def sort_by_input(self) -> None:
        """Merge all shards into one file in input order; a kill midway is finished by repair()."""
        shards = self.store.shards()
        if not shards or len(shards) == 1 and shards[0][0] == "sorted":
            return
        # the sorted file takes the last shard's number: repair() then drops every shard up to it
        self._write(self.store.read().sort_by("row_index"), "sorted", shards[-1][1])
        self.store.repair()


class JobLock:
    """An flock on OUT/.lock: a second submit of the job exits at once; the kernel drops it if we are killed."""

    def __init__(self, out_dir: str):
        self.path = os.path.join(out_dir, ".lock")
        self.fd = None

    def __enter__(self) -> "JobLock":
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip() or "another process"
            os.close(self.fd)
            raise JobError(f"{self.path}: the job is already running (pid {holder}); this submit exits",
                           EXIT_LOCKED) from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)

    @staticmethod
    def held(out_dir: str) -> bool:
        """Whether a submit holds the job's lock now (checked with a shared, non-blocking flock)."""
        try:
            fd = os.open(os.path.join(out_dir, ".lock"), os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
