"""The job's Parquet input as a Ray Data datasource: one read task per row group, each row tagged with its
row_index (its position in the input, the row's identity in the output), rows already done left out.

Not `ray.data.read_parquet`: it cannot say where a row sits in the input, and a resume would have to read every
row to drop the done ones; here a row group whose rows are all done is not read at all.
"""
from __future__ import annotations

from typing import Iterable

import pyarrow as pa
import pyarrow.parquet as pq
from ray.data import Datasource, ReadTask
from ray.data.block import BlockMetadata

from batchrun.job.storage import open_input


def row_groups(files: list[str], limit: int | None, options: dict | None = None) -> list[tuple[str, int, int, int]]:
    """(file, row group, first row_index, rows) for every row group up to the input limit."""
    groups, start = [], 0
    for path in files:
        meta = pq.ParquetFile(open_input(path, options)).metadata
        for group in range(meta.num_row_groups):
            rows = meta.row_group(group).num_rows
            if limit is not None:
                rows = min(rows, limit - start)
            if rows > 0:
                groups.append((path, group, start, rows))
            start += rows
            if limit is not None and start >= limit:
                return groups
    return groups


class JobInput(Datasource):
    def __init__(self, files: list[str], columns: list[str], limit: int | None, done: set[int],
                 options: dict | None = None):
        super().__init__()
        self.columns, self.options = columns, options   # options: storage.options, for URIs (no credentials)
        # per row group, only the done indices inside it travel with its read task
        self.groups = []
        for path, group, start, rows in row_groups(files, limit, options):
            skip = frozenset(i for i in range(start, start + rows) if i in done)
            if len(skip) < rows:
                self.groups.append((path, group, start, rows, skip))

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context=None) -> list[ReadTask]:
        tasks = []
        for path, group, start, rows, skip in self.groups:
            metadata = BlockMetadata(num_rows=rows - len(skip), size_bytes=None, exec_stats=None, input_files=(path,))
            tasks.append(ReadTask(self._reader(path, group, start, rows, skip), metadata))
        return tasks

    def _reader(self, path: str, group: int, start: int, rows: int, skip: frozenset):
        columns, options = self.columns, self.options

        def read() -> Iterable[pa.Table]:   # a URI is opened where the task runs, with that node's credentials
            table = pq.ParquetFile(open_input(path, options)).read_row_group(group, columns=columns).slice(0, rows)
            table = table.append_column("row_index", pa.array(range(start, start + rows), pa.int64()))
            if skip:
                keep = [i not in skip for i in range(start, start + rows)]
                table = table.filter(pa.array(keep))
            yield table
        return read
