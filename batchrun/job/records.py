"""The output rows of one input row: one per sample (n > 1 gives n, with a sample_index column), and with
output.parse_json the parsed, validated JSON, or the row's failure when the output is not what was asked for."""
from __future__ import annotations

import functools
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
        generated = out is not None and out.finish_reason != "error"
        ok, error, parsed = generated, None if generated else (row.error or out.error), None
        if generated and self.parse_json:
            parsed, error = parse_output(out.text, out.finish_reason, row.params.constraint)
            ok = error is None
        record = {"id": row.id, "text": out.text if generated else None,
                  "finish_reason": out.finish_reason if out else "error",
                  "prompt_tokens": out.prompt_tokens if out else len(row.token_ids or []),
                  "completion_tokens": len(out.token_ids) if generated else 0,
                  "status": "ok" if ok else "error", "error": error, "latency": out.latency if out else None,
                  "time_to_first_token": out.time_to_first_token if out else None,
                  "cached_tokens": out.cached_tokens if out else 0, "row_index": row.index, **row.passthrough}
        if self.samples:
            record["sample_index"] = sample_index
        if self.parse_json:
            record["json"] = parsed
        return record


def parse_output(text: str, finish_reason: str, constraint: tuple[str, str] | None) -> tuple[str | None, str | None]:
    """(the value as strict JSON text, None) or (None, why not); checked against the row's JSON schema when it has
    one. Raw control characters inside strings (which xgrammar's JSON grammar lets through) are accepted and written
    back escaped."""
    try:
        value = json.loads(text, strict=False)
    except ValueError as exc:
        if finish_reason == "length":
            return None, "length: incomplete JSON (max_tokens reached)"
        return None, f"json: the output is not valid JSON ({exc})"
    if constraint is not None and constraint[0] == "json_schema":
        error = jsonschema.exceptions.best_match(_validator(constraint[1]).iter_errors(value))
        if error is not None:
            return None, f"json: the output does not match the schema ({error.message})"
    return json.dumps(value, ensure_ascii=False), None


@functools.lru_cache(maxsize=256)
def _validator(schema: str):
    """A validator per distinct schema text (jsonschema.validate would check the schema itself again every row)."""
    loaded = json.loads(schema)
    return jsonschema.validators.validator_for(loaded)(loaded)
