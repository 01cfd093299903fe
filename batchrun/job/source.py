"""Input rows, streamed: Parquet record batches (here) or OpenAI batch JSONL (openai_batch.py).

Schema problems (missing file, corrupt Parquet, missing column, wrong type) fail the job before any work;
problems of one row (null prompt, bad parameter) become that row's error.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.job.errors import JobError
from batchrun.job.spec import JobSpec
from batchrun.job.storage import StorageError, find_files, open_input
from batchrun.job.storage import fingerprint as file_fingerprint
from batchrun.sampling_params import SamplingParams

ROW_PARAM_COLUMNS = {"max_tokens_column": "max_tokens", "temperature_column": "temperature",
                     "top_p_column": "top_p", "seed_column": "seed", "json_schema_column": "json_schema",
                     "adapter_column": "adapter"}
_INTEGER, _NUMBER = "integers", "numbers"
_TEXT, _NAME = "text (a JSON schema)", "text (an adapter name)"
_KINDS = {"max_tokens_column": _INTEGER, "seed_column": _INTEGER, "temperature_column": _NUMBER,
          "top_p_column": _NUMBER, "json_schema_column": _TEXT, "adapter_column": _NAME}


@dataclass
class Row:
    index: int                               # position in the input: the row's identity in the output
    id: Any
    prompt: str | list | None = None         # text or chat messages
    params: SamplingParams | None = None     # built once when the row is read; rides with it to the engine
    passthrough: dict = field(default_factory=dict)
    error: str | None = None
    token_ids: list[int] | None = None


class InvalidText(str):
    """A string value that is not valid UTF-8 (some writers produce it), decoded with replacement characters so the
    row can still be written; the row fails, naming the column, and the rest of the job runs."""


def column_values(column: pa.Array) -> list:
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        return [_value(column[i]) for i in range(len(column))]


def _value(scalar: pa.Scalar):
    try:
        return scalar.as_py()
    except UnicodeDecodeError:
        raw = scalar.as_buffer().to_pybytes() if hasattr(scalar, "as_buffer") else b"\xff"   # nested: no bytes
        return InvalidText(raw.decode("utf-8", errors="replace"))


def records(batch: pa.RecordBatch) -> list[dict]:
    """The batch's rows as dicts; invalid UTF-8 becomes InvalidText in that row alone."""
    try:
        return batch.to_pylist()
    except UnicodeDecodeError:
        names = batch.schema.names
        return [dict(zip(names, values)) for values in zip(*(column_values(c) for c in batch.columns))]


def set_params(spec: JobSpec, row: Row, overrides: dict, origin: dict[str, str]) -> None:
    """The row's SamplingParams: the job's sampling section under the row's own values; a bad value fails the row,
    its message naming where the value came from (origin: parameter -> e.g. "column 'temp'")."""
    try:
        row.params = spec.sampling_params(**overrides)
    except (ValueError, TypeError) as exc:
        field, _, message = str(exc).partition(": ")
        row.error = f"{origin[field]}: {message}" if field in origin else f"{exc} (with this row's values)"


def input_files(spec: JobSpec) -> list[str]:
    """The input path as a file, a directory or prefix (its *.parquet / *.jsonl, sorted) or a glob; a URI's files
    as URIs."""
    path = spec.resolve(spec.input.path)
    ext = ".jsonl" if spec.input.format == "openai_batch" else ".parquet"
    try:
        files = find_files(path, ext, spec.storage.options)
    except StorageError as exc:
        raise spec.fail(("input", "path"), f"cannot list {exc}") from None
    if not files:
        raise spec.fail(("input", "path"), f"no input file at {path}")
    return files


def fingerprint(files: list[str], options: dict | None = None) -> list[tuple]:
    return [file_fingerprint(f, options) for f in files]


class ParquetSource:
    def __init__(self, spec: JobSpec):
        self.spec, self.inp = spec, spec.input
        self.files = input_files(spec)
        self.id_type = None
        for path in self.files:
            self._check_schema(path)

    def _open(self, path: str) -> pq.ParquetFile:
        try:
            return pq.ParquetFile(open_input(path, self.spec.storage.options))
        except (OSError, pa.ArrowException, StorageError) as exc:
            raise JobError(f"{path}: not a readable Parquet file ({exc}); check input.path") from exc

    def _check_schema(self, path: str) -> None:
        schema = self._open(path).schema_arrow
        inp = self.inp

        def need(key: str, column: str, ok=None, kind: str = ""):
            if column not in schema.names:
                raise JobError(f"{path}: no column {column!r} (input.{key}); columns: {', '.join(schema.names)}")
            t = schema.field(column).type
            if ok and not ok(t):
                raise JobError(f"{path}: column {column!r} (input.{key}) must hold {kind}, but its type is {t}")
            return t

        id_type = _plain_type(need("id_column", inp.id_column, lambda t: _is_text(t) or pa.types.is_integer(t),
                                   "strings or integers"))
        if self.id_type is not None and id_type != self.id_type:
            raise JobError(f"{path}: column {inp.id_column!r} has type {id_type}, but {self.files[0]} has "
                           f"{self.id_type}; all input files must agree")
        self.id_type = id_type
        if inp.prompt_column:
            need("prompt_column", inp.prompt_column, _is_text, "text (string)")
        if inp.messages_column:
            need("messages_column", inp.messages_column, _is_messages,
                 "chat messages (a list of structs with string fields role and content)")
        for column in inp.template_columns:
            need("template", column)
        for key, kind in _KINDS.items():
            if getattr(inp, key):
                need(key, getattr(inp, key), pa.types.is_integer if kind == _INTEGER else _is_text
                     if kind in (_TEXT, _NAME) else lambda t: pa.types.is_integer(t) or pa.types.is_floating(t), kind)
        for column in inp.passthrough:
            need("passthrough", column)

    def passthrough_schema(self) -> list[pa.Field]:
        schema = self._open(self.files[0]).schema_arrow
        return [schema.field(c).with_type(_plain_type(schema.field(c).type)) for c in self.inp.passthrough]

    def input_table(self) -> pa.Table:
        """Every input column, in input order up to input.limit, with each row's row_index."""
        table = pa.concat_tables([self._open(path).read() for path in self.files], promote_options="default")
        if self.inp.limit is not None:
            table = table.slice(0, self.inp.limit)
        return table.append_column("row_index", pa.array(range(table.num_rows), pa.int64()))

    def scan_ids(self) -> Iterator[tuple[str, int, Any]]:
        """(file, row in that file, id) in input order (only the id column is read), up to input.limit."""
        left = self.inp.limit
        for path in self.files:
            position = 0
            for batch in self._open(path).iter_batches(columns=[self.inp.id_column], batch_size=65536):
                ids = column_values(batch.column(0))
                for value in ids[:left] if left is not None else ids:
                    yield path, position, value
                    position += 1
                if left is not None:
                    left -= min(left, len(ids))
                    if left == 0:
                        return

    def columns(self) -> list[str]:
        """The input columns the job uses (the only ones read)."""
        inp = self.inp
        columns = [inp.id_column, inp.prompt_column, inp.messages_column, *inp.template_columns,
                   *(getattr(inp, k) for k in ROW_PARAM_COLUMNS), *inp.passthrough]
        return list(dict.fromkeys(c for c in columns if c))

    def batches(self, batch_size: int = 1024) -> Iterator[list[Row]]:
        """Rows in input order, one record batch at a time (only the columns the job uses are read)."""
        columns, index, left = self.columns(), 0, self.inp.limit
        for path in self.files:
            for batch in self._open(path).iter_batches(columns=columns, batch_size=batch_size):
                rows = records(batch)
                if left is not None:
                    rows, left = rows[:left], left - min(left, len(rows))
                yield [self._row(index + i, r) for i, r in enumerate(rows)]
                index += len(rows)
                if left == 0:
                    return

    def _row(self, index: int, r: dict) -> Row:
        return row_from_record(self.spec, index, r)


def row_from_record(spec: JobSpec, index: int, r: dict) -> Row:
    """A Row from one input record (its columns by name): prompt, parameters, passthrough, or the row's error."""
    inp = spec.input
    row = Row(index, r[inp.id_column], passthrough={c: r[c] for c in inp.passthrough})
    if row.id is None:
        row.error = f"input: null id in column {inp.id_column!r}"
        return row
    invalid = next((column for column, value in r.items() if isinstance(value, InvalidText)), None)
    if invalid:
        row.error = f"input: column {invalid!r} holds text that is not valid UTF-8 in this row"
        return row
    columns = {param: getattr(inp, key) for key, param in ROW_PARAM_COLUMNS.items() if getattr(inp, key)}
    set_params(spec, row, {param: r[column] for param, column in columns.items()},
               {param: f"{param} (column {column!r})" for param, column in columns.items()})
    if inp.template:
        missing = [c for c in inp.template_columns if r[c] is None]
        if missing:
            row.error = row.error or f"prompt: template column {missing[0]!r} is null"
        else:
            row.prompt = inp.template.format_map(r)
    else:
        row.prompt = r[inp.messages_column or inp.prompt_column]
    return row


def _is_text(t: pa.DataType) -> bool:
    """Strings in any of Arrow's layouts: plain, large, view, or dictionary-encoded (pandas' category columns)."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _plain_type(t: pa.DataType) -> pa.DataType:
    """The type of the values as read (to_pylist), which is what the output holds: a dictionary's values."""
    t = t.value_type if pa.types.is_dictionary(t) else t
    return pa.string() if pa.types.is_string_view(t) else t


def _is_messages(t: pa.DataType) -> bool:
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not pa.types.is_struct(t.value_type):
        return False
    names = {t.value_type.field(i).name: t.value_type.field(i).type for i in range(t.value_type.num_fields)}
    return all(k in names and _is_text(names[k]) for k in ("role", "content"))
