"""Results as Parquet shards in OUT/data: each written to a hidden temporary name, fsynced, then renamed.

The renamed shards are the checkpoint: a row is done exactly when it is in one, so a kill at any moment loses
only rows not yet in a shard (they run again) and never duplicates one. Readers skip the hidden temporaries.
An output on an object store (a URI) has no rename: its shards are kept by object_shards.py, its lock by
object_lock.py; shard_store and job_lock pick the kind.
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import re
import shutil
import time

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from batchrun.job.atomic import atomic_write, fsync_dir
from batchrun.job.errors import EXIT_LOCKED, JobError
from batchrun.job.object_lock import NoConditionalPut, ObjectLock
from batchrun.job.object_shards import ObjectShardStore, shard_name
from batchrun.job.storage import Storage, as_storage

# part-NNNNNN.parquet from a local run; part-NNNNNN-<digest>.parquet from a Ray run (NNNNNN: that run's number, the
# digest: of the shard's row indices, so a retried batch rewrites its own shard)
_PART = re.compile(r"(part|sorted)-(\d{6})(?:-[0-9a-f]{16})?\.parquet$")
MERGE_ROWS = 65536   # row indices per file of the merged output (output.order: input)


def result_schema(id_type: pa.DataType, passthrough: list[pa.Field]) -> pa.Schema:
    return pa.schema([pa.field("id", id_type), ("text", pa.string()), ("finish_reason", pa.string()),
                      ("prompt_tokens", pa.int32()), ("completion_tokens", pa.int32()), ("status", pa.string()),
                      ("error", pa.string()), ("latency", pa.float64()), ("time_to_first_token", pa.float64()),
                      ("cached_tokens", pa.int32()), ("row_index", pa.int64()), *passthrough])


def shard_store(out: Storage | str) -> "ShardStore | ObjectShardStore":
    """The shards of an output: a local directory's (rename) or an object store's (manifest entries)."""
    out = as_storage(out)
    return ShardStore(out.root) if out.local else ObjectShardStore(out)


class ShardStore:
    """The shards of one output directory: list, read, finish what a killed run left."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.dir = os.path.join(out_dir, "data")
        self.staging = os.path.join(out_dir, ".data.sorting")   # the merged output, being written
        self.old = os.path.join(out_dir, ".data.old")           # the shards, during the swap

    def shards(self) -> list[tuple[str, int, str]]:
        """(kind, number, path) of the shards, in number order."""
        found = []
        for path in glob.glob(os.path.join(self.dir, "*.parquet")):
            m = _PART.search(path)
            if m:
                found.append((m.group(1), int(m.group(2)), path))
        return sorted(found, key=lambda s: (s[1], s[2]))

    def repair(self) -> None:
        """Delete temporaries of a killed shard writer; finish or roll back a swap of the merged output."""
        if os.path.isdir(self.old):
            if os.path.isdir(self.dir):
                shutil.rmtree(self.old)               # the merged output is in place
            else:
                os.replace(self.old, self.dir)        # killed between the two renames: the shards come back
        shutil.rmtree(self.staging, ignore_errors=True)
        for path in glob.glob(os.path.join(self.dir, ".*.tmp")):
            os.remove(path)

    def read(self, columns: list[str] | None = None) -> pa.Table | None:
        paths = [p for _, _, p in self.shards()]
        if not paths:
            return None
        return pa.concat_tables([pq.read_table(p, columns=columns) for p in paths], promote_options="default")

    def done_indices(self) -> set[int]:
        table = self.read(["row_index"])
        return set() if table is None else set(table.column(0).to_pylist())


def write_shard(directory: str, name: str, table: pa.Table) -> None:
    """A shard appears whole under its name or not at all (atomic_write)."""
    atomic_write(os.path.join(directory, name), lambda f: pq.write_table(table, f))


class ResultSink:
    def __init__(self, out_dir: Storage | str, schema: pa.Schema, shard_rows: int, flush_every_s: float):
        out = as_storage(out_dir)
        self.store = shard_store(out)
        self.local = out.local
        if self.local:
            os.makedirs(self.store.dir, exist_ok=True)
        self.store.repair()
        self.schema, self.shard_rows, self.flush_every_s = schema, shard_rows, flush_every_s
        self.seq = max((seq for _, seq, _ in self.store.shards()), default=0) + 1
        self.pending: list[dict] = []
        self.last_flush = time.monotonic()
        self.rows_written = 0

    def add(self, records: list[dict]) -> None:
        """One input row's results (its samples), together: they land in one shard, so a row is done or not."""
        self.pending.extend(records)
        if len(self.pending) >= self.shard_rows or time.monotonic() - self.last_flush >= self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        self.last_flush = time.monotonic()
        if not self.pending:
            return
        table = pa.Table.from_pylist(self.pending, schema=self.schema)
        if self.local:
            write_shard(self.store.dir, f"part-{self.seq:06d}.parquet", table)
        else:   # the row indices in the name: a second writer of the same rows writes the same object
            self.store.commit(shard_name(self.seq, [r["row_index"] for r in self.pending]), table)
        self.seq += 1
        self.rows_written += len(self.pending)
        self.pending = []

    def sort_by_input(self) -> None:
        """Rewrite the output in input order, MERGE_ROWS row indices per file (memory stays bounded however large
        the output), into a staging directory that then replaces data/ by two renames: a reader of data/ sees the
        shards or the merged files, never both. A kill midway is finished or rolled back by repair(). On an object
        store the merged files are committed beside the shards and a manifest entry switches readers to them
        (object_shards.py)."""
        if not self.local:
            self.store.sort_by_input(self.schema, MERGE_ROWS)
            return
        shards = self.store.shards()
        if not shards or all(kind == "sorted" for kind, _, _ in shards):
            return
        dataset = ds.dataset([p for _, _, p in shards], format="parquet", schema=self.schema)
        last = pc.max(dataset.to_table(columns=["row_index"]).column(0)).as_py()
        os.makedirs(self.store.staging)
        for number, start in enumerate(range(0, last + 1, MERGE_ROWS), 1):
            in_slice = (pc.field("row_index") >= start) & (pc.field("row_index") < start + MERGE_ROWS)
            rows = dataset.to_table(filter=in_slice)
            if rows.num_rows:
                write_shard(self.store.staging, f"sorted-{number:06d}.parquet", rows.sort_by("row_index"))
        os.replace(self.store.dir, self.store.old)
        os.replace(self.store.staging, self.store.dir)
        fsync_dir(self.store.out_dir)
        shutil.rmtree(self.store.old)


def job_lock(out: Storage, lease_s: float, force: bool, on_lost) -> "JobLock | ObjectLock | contextlib.nullcontext":
    """The job's lock: an flock on a local output, a lease object on S3. A store where batchrun cannot take one
    (no conditional PUT) is refused unless force: the user then answers for running one submit at a time."""
    if out.local:
        return JobLock(out.root)
    try:
        lock = ObjectLock(out, lease_s, on_lost)
        lock.check_conditional_put()
        return lock
    except NoConditionalPut as exc:
        if force:
            return contextlib.nullcontext()
        raise JobError(f"{out.root}: cannot lock the job's output: {exc}; make sure only one submit of this job "
                       f"runs at a time, then submit with --force") from None


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
