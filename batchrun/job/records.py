"""The output rows of one input row: one per sample (n > 1 gives n, with a sample_index column), and with
output.parse_json the parsed, validated JSON, or the row's failure when the output is not what was asked for."""
from __future__ import annotations

import json

import jsonschema
import pyarrow as pa

from batchrun.job.source import Row
from batchrun.job.spec import JobSpec


def has_samples(spec: JobSpec) -> bool:
    """Whether rows may have several samples: n > 1 in the job, or OpenAI batch requests (each body has its n)."""
    return spec.sampling.n > 1 or spec.input.format == "openai_batch"


def extra_columns(spec: JobSpec) -> list[pa.Field]:
    """Columns the job adds to the standard result schema."""
    return ([pa.field("sample_index", pa.int32())] if has_samples(spec) else []) + \
        ([pa.field("json", pa.string())] if spec.output.parse_json else [])


class RecordMaker:
    def __init__(self, spec: JobSpec):
        self.samples = has_samples(spec)
        self.parse_json = spec.output.parse_json
        self.n = spec.sampling.n

    def records(self, row: Row, outs: list | None = None) -> list[dict]:
        """The output rows of `row`: from its samples' final outputs, or failed ones (a bad row, or a request that
        ended before its first token) for each sample it would have had."""
        if outs and (len(outs) > 1 or outs[0].token_ids):
            return [self._record(row, out, out.sample_index) for out in sorted(outs, key=lambda o: o.sample_index)]
        out = outs[0] if outs else None
        n = row.params.n if row.params is not None else self.n
        return [self._record(row, out, k) for k in range(n if self.samples else 1)]

    def _record(self, row: Row, out, sample_index: int) -> dict:
        ok = out is not None and out.finish_reason != "error"
        error = None if ok else (row.error or out.error)
        parsed = None
        if ok and self.parse_json:
            parsed, error = parse_output(out.text, out.finish_reason, row.params.json_schema)
            ok = error is None
        record = {"id": row.id, "text": out.text if out is not None and out.finish_reason != "error" else None,
                  "finish_reason": out.finish_reason if out else "error",
                  "prompt_tokens": out.prompt_tokens if out else len(row.token_ids or []),
                  "completion_tokens": len(out.token_ids) if out is not None and out.finish_reason != "error" else 0,
                  "status": "ok" if ok else "error", "error": error, "latency": out.latency if out else None,
                  "time_to_first_token": out.time_to_first_token if out else None,
                  "cached_tokens": out.cached_tokens if out else 0, "row_index": row.index, **row.passthrough}
        if self.samples:
            record["sample_index"] = sample_index
        if self.parse_json:
            record["json"] = parsed
        return record


def parse_output(text: str, finish_reason: str, schema) -> tuple[str | None, str | None]:
    """(the value as strict JSON text, None) or (None, why not). Raw control characters inside strings (which
    xgrammar's JSON grammar lets through) are accepted and written back escaped."""
    try:
        value = json.loads(text, strict=False)
    except ValueError as exc:
        if finish_reason == "length":
            return None, "length: incomplete JSON (max_tokens reached)"
        return None, f"json: the output is not valid JSON ({exc})"
    if schema is not None:
        try:
            jsonschema.validate(value, json.loads(schema) if isinstance(schema, str) else schema)
        except jsonschema.ValidationError as exc:
            return None, f"json: the output does not match the schema ({exc.message})"
    return json.dumps(value, ensure_ascii=False), None
