"""Result shards on an object store (or any filesystem behind a URI), exactly once without rename.

A shard is written under its final name in one PUT (or one completed multipart upload), so a listing never shows
part of one; its name carries the digest of its row indices (two writers of the same rows write the same object).
After it, a manifest entry: an empty object OUT/data/_committed/<shard>.r<rows>.f<failed>.p<prompt>.c<completion>
whose name carries the shard's counts. A reader (resume, status, the merge) trusts a shard only when both exist, so
a shard whose writer was killed before its entry is never counted (the next run deletes it and runs its rows
again), and `status` counts the output from one listing, with no per-shard read. Rows that two writers both
committed (only a lost lock lets that happen) are read once: the first shard's copy.

output.order: input writes sorted-NNNNNN.parquet shards (with entries) beside the part shards, then the entry
_committed/_merged: from then on readers trust the sorted shards only, and the part shards are deleted. A kill
before _merged leaves the part shards in force (the sorted ones are deleted by the next run); after it, the next
run finishes the deletion.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from batchrun.job.storage import Storage

_SHARD = re.compile(r"^(part|sorted)-(\d{6})(?:-[0-9a-f]{16})?\.parquet$")
_ENTRY = re.compile(r"^(?P<shard>.+\.parquet)\.r(?P<rows>\d+)\.f(?P<failed>\d+)\.p(?P<prompt>\d+)\.c(?P<completion>\d+)$")
ENTRIES = "_committed"
MERGED = "_merged"


@dataclass
class Listing:
    """One listing of OUT/data: the trusted shards (kind, number, name) in number order and their counts."""
    shards: list[tuple[str, int, str]] = field(default_factory=list)
    counts: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)   # name -> rows, failed, tokens
    untrusted: list[str] = field(default_factory=list)   # files to delete: no entry, or left by a merge
    merged: bool = False


def shard_name(number: int, row_indices: list[int]) -> str:
    """part-NNNNNN-<digest of the row indices>.parquet (a Ray run's shard names have the same form)."""
    digest = hashlib.sha256(",".join(map(str, sorted(row_indices))).encode()).hexdigest()[:16]
    return f"part-{number:06d}-{digest}.parquet"


def shard_counts(table: pa.Table) -> tuple[int, int, int, int]:
    """Input rows, failed input rows, prompt and completion tokens of one shard (as report.counts counts them)."""
    rows = pc.count_distinct(table["row_index"]).as_py()
    failed = pc.count_distinct(table["row_index"].filter(pc.equal(table["status"], "error"))).as_py()
    # an input row's n samples share its prompt: count it once, as OpenAI's usage does
    prompts = table.group_by("row_index").aggregate([("prompt_tokens", "max")]).column("prompt_tokens_max")
    return (rows, failed, int(pc.sum(prompts).as_py() or 0), int(pc.sum(table["completion_tokens"]).as_py() or 0))


class ObjectShardStore:
    def __init__(self, out: Storage):
        self.out = out
        self.dir = out.join("data")

    def listing(self) -> Listing:
        files = {self.out.name_of(info)[len("data/"):] for info in self.out.list("data")}
        merged = f"{ENTRIES}/{MERGED}" in files
        entries: dict[str, tuple] = {}
        for name in files:
            match = _ENTRY.match(name[len(ENTRIES) + 1:]) if name.startswith(ENTRIES + "/") else None
            if match:
                entries[match["shard"]] = tuple(int(match[k]) for k in ("rows", "failed", "prompt", "completion"))
        view = Listing(merged=merged)
        for name in files:
            match = _SHARD.match(name)
            if not match:
                continue
            if name in entries and (match.group(1) == "sorted") == merged:
                view.shards.append((match.group(1), int(match.group(2)), name))
                view.counts[name] = entries[name]
            else:
                view.untrusted.append(name)
        view.shards.sort(key=lambda s: (s[1], s[2]))
        return view

    def shards(self) -> list[tuple[str, int, str]]:
        return self.listing().shards

    def commit(self, name: str, table: pa.Table) -> None:
        """The shard in one PUT, then its manifest entry (with its counts in the name)."""
        self.out.write(f"data/{name}", lambda f: pq.write_table(table, f))
        rows, failed, prompt, completion = shard_counts(table)
        self.out.write(f"data/{ENTRIES}/{name}.r{rows}.f{failed}.p{prompt}.c{completion}", b"")

    def _delete(self, names: list[str]) -> None:
        """Shards and their entries: the entry first, so a kill midway never leaves a trusted shard half gone."""
        entries = {self.out.name_of(i)[len("data/"):] for i in self.out.list(f"data/{ENTRIES}")}
        for name in names:
            for entry in [e for e in entries if e.startswith(f"{ENTRIES}/{name}.")]:
                self.out.remove(f"data/{entry}")
            self.out.remove(f"data/{name}")

    def repair(self) -> None:
        """Delete shards without a manifest entry (their writer was killed, or a merge left them)."""
        view = self.listing()
        if view.untrusted:
            self._delete(view.untrusted)

    def _dataset(self, names: list[str], schema: pa.Schema | None = None) -> ds.Dataset:
        paths = [self.out.fs_path(f"data/{name}") for name in names]
        return ds.dataset(paths, filesystem=self.out.fs, format="parquet", schema=schema)

    def read(self, columns: list[str] | None = None) -> pa.Table | None:
        view = self.listing()
        if not view.shards:
            return None
        dataset = self._dataset([name for _, _, name in view.shards])
        keys = [k for k in ("row_index", "sample_index") if k in dataset.schema.names]
        wanted = None if columns is None else list(dict.fromkeys([*columns, *keys]))
        table = dataset.to_table(columns=wanted)
        table = first_copies(table)
        return table if columns is None else table.select(columns)

    def done_indices(self) -> set[int]:
        table = self.read(["row_index"])
        return set() if table is None else set(table.column(0).to_pylist())

    def counts(self) -> dict:
        """Rows done, ok, failed and tokens from the listing alone."""
        listed = self.listing().counts.values()
        totals = [sum(c[i] for c in listed) for i in range(4)]
        return {"rows_done": totals[0], "rows_ok": totals[0] - totals[1], "rows_failed": totals[1],
                "prompt_tokens": totals[2], "completion_tokens": totals[3]}

    def sort_by_input(self, schema: pa.Schema, merge_rows: int) -> None:
        view = self.listing()
        if not view.shards or view.merged:
            return
        parts = [name for _, _, name in view.shards]
        dataset = self._dataset(parts, schema)
        last = pc.max(dataset.to_table(columns=["row_index"]).column(0)).as_py()
        for number, start in enumerate(range(0, last + 1, merge_rows), 1):
            in_slice = (pc.field("row_index") >= start) & (pc.field("row_index") < start + merge_rows)
            rows = first_copies(dataset.to_table(filter=in_slice))
            if rows.num_rows:
                self.commit(f"sorted-{number:06d}.parquet", rows.sort_by("row_index"))
        self.out.write(f"data/{ENTRIES}/{MERGED}", b"")
        self._delete(parts)


def first_copies(table: pa.Table) -> pa.Table:
    """Each output row (row_index, and sample_index where there is one) once: its first copy in shard order."""
    keys = ["row_index"] + (["sample_index"] if "sample_index" in table.column_names else [])
    if table.num_rows == 0:
        return table
    numbered = table.append_column("__position", pa.array(range(table.num_rows), pa.int64()))
    first = numbered.group_by(keys, use_threads=False).aggregate([("__position", "min")])
    if first.num_rows == table.num_rows:
        return table
    positions = first["__position_min"]
    return table.take(positions.take(pc.sort_indices(positions)))
