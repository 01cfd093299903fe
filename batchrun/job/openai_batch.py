"""OpenAI Batch API files: requests JSONL in (as job rows), results JSONL out, so client code keeps working.

A request line: {"custom_id": "...", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
"body": {"model": ..., "messages": [...] | "prompt": "...", "max_tokens", "temperature", "top_p", "seed", "stop", "n",
"response_format"}}. A body with n > 1 gets one output row per sample and n choices in its response.
A malformed line fails alone: its row gets status "error" and the reason.
"""
from __future__ import annotations

import itertools
import json
import os
import time
from typing import Any, Iterator

import pyarrow as pa

from batchrun.job.errors import JobError
from batchrun.job.source import Row, input_files, set_params
from batchrun.job.spec import JobSpec
from batchrun.job.storage import Storage, iter_lines, readable
from batchrun.structured import from_response_format

URLS = ("/v1/chat/completions", "/v1/completions")
BODY_PARAMS = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
               "top_p": "top_p", "seed": "seed", "stop": "stop", "n": "n"}


class OpenAIBatchSource:
    id_type = pa.string()

    def __init__(self, spec: JobSpec):
        self.spec, self.inp = spec, spec.input
        self.files = input_files(spec)
        self.adapters = set(spec.engine_options.get("adapters") or ())   # body.model may name one
        if self.inp.passthrough:
            raise spec.fail(("input", "passthrough"), "is not supported for OpenAI batch input")
        for path in self.files:
            if not readable(path, spec.storage.options):
                raise JobError(f"{path}: cannot read the OpenAI batch file (input.path)")

    def passthrough_schema(self) -> list[pa.Field]:
        return [pa.field("url", pa.string())]

    def _adapter(self, model) -> dict:
        """body.model as the row's adapter, where the job has adapters (without, body.model is not read): the base
        model's name (as the job gives it, or its directory's name) selects none; any other name is the adapter (an
        unknown one fails the row, naming it)."""
        base = self.spec.model
        if not self.adapters or model is None or model in (base, os.path.basename(base.rstrip("/"))):
            return {}
        return {"adapter": model}

    def _lines(self) -> Iterator[tuple[str, int, str]]:
        left = self.inp.limit
        for path in self.files:
            for number, line in enumerate(iter_lines(path, self.spec.storage.options), 1):
                if not line.strip():
                    continue
                if left is not None:
                    if left == 0:
                        return
                    left -= 1
                yield path, number, line

    def input_table(self) -> pa.Table:
        """The requests as they are in the files: custom_id, the request line (JSON text) and its row_index."""
        ids, lines = [], []
        for path, number, line in self._lines():
            ids.append(_parse(path, number, line)[0])
            lines.append(line.decode("utf-8", errors="replace").strip())
        return pa.table({"custom_id": ids, "request": lines, "row_index": list(range(len(ids)))})

    def scan_ids(self) -> Iterator[tuple[str, int, Any]]:
        """(file, line number, custom_id) in input order."""
        for path, number, line in self._lines():
            yield path, number, _parse(path, number, line)[0]

    def batches(self, batch_size: int = 1024) -> Iterator[list[Row]]:
        rows: list[Row] = []
        for index, (path, number, line) in enumerate(self._lines()):
            custom_id, request, error = _parse(path, number, line)
            row = Row(index, custom_id, passthrough={"url": (request or {}).get("url")}, error=error)
            if error is None:
                body = request["body"]
                row.prompt = body.get("messages") if request["url"] == URLS[0] else body.get("prompt")
                try:
                    structured = from_response_format(body.get("response_format"))
                except ValueError as exc:
                    row.error = f"{os.path.basename(path)} line {number}: body.{exc}"
                else:
                    given = {k: p for k, p in BODY_PARAMS.items() if body.get(k) is not None}
                    where = f"{os.path.basename(path)} line {number}: body."
                    set_params(self.spec, row, {**{p: body[k] for k, p in given.items()}, **structured,
                                                **self._adapter(body.get("model"))},
                               {**{p: where + k for k, p in given.items()},
                                **{k: where + "response_format" for k in structured}, "adapter": where + "model"})
            rows.append(row)
            if len(rows) == batch_size:
                yield rows
                rows = []
        if rows:
            yield rows


def _parse(path: str, number: int, raw: bytes) -> tuple[str, dict | None, str | None]:
    """(custom_id, request, error); a line without a usable custom_id is named after its line."""
    where = f"{os.path.basename(path)} line {number}"
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"line-{number}", None, f"{where}: not valid UTF-8 (byte {exc.start} of the line)"
    try:
        request = json.loads(line)
    except json.JSONDecodeError as exc:
        return f"line-{number}", None, f"{where}: not valid JSON ({exc.msg} at column {exc.colno})"
    if not isinstance(request, dict):
        return f"line-{number}", None, f"{where}: expected a JSON object"
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return f"line-{number}", None, f"{where}: custom_id must be a non-empty string"
    body, url = request.get("body"), request.get("url")
    if url not in URLS:
        return custom_id, None, f"{where}: url {url!r} is not supported; use one of {', '.join(URLS)}"
    if not isinstance(body, dict):
        return custom_id, None, f"{where}: body must be a JSON object"
    key = "messages" if url == URLS[0] else "prompt"
    value = body.get(key)
    if url == URLS[0] and not (isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m for m in value)):
        return custom_id, None, f"{where}: body.messages must be a list of {{role, content}} objects"
    if url == URLS[1] and not isinstance(value, str):
        return custom_id, None, f"{where}: body.prompt must be a string"
    return custom_id, request, None


def write_output(table: pa.Table, out: Storage, name: str, model: str) -> None:
    """Results as OpenAI batch output JSONL, in input order, written whole or not at all (Storage.write)."""
    created = int(time.time())

    def lines(f):
        rows = table.sort_by([("row_index", "ascending"), ("sample_index", "ascending")]).to_pylist()
        for _, samples in itertools.groupby(rows, key=lambda r: r["row_index"]):
            samples = list(samples)
            first = samples[0]
            line = {"id": f"batch_req_{first['row_index']}", "custom_id": first["id"], "response": None,
                    "error": None}
            failed = next((r for r in samples if r["status"] != "ok"), None)
            if failed is None:
                line["response"] = {"status_code": 200, "request_id": f"req_{first['row_index']}",
                                    "body": _body(samples, model, created)}
            else:
                line["error"] = {"code": "invalid_request", "message": failed["error"]}
            f.write((json.dumps(line, ensure_ascii=False) + "\n").encode())
    out.write(name, lines)


def _body(samples: list[dict], model: str, created: int) -> dict:
    """One request's response body: a choice per sample, usage with the prompt counted once."""
    first = samples[0]
    chat = first.get("url") == URLS[0]
    choices = []
    for r in samples:
        choice = {"index": r["sample_index"], "finish_reason": r["finish_reason"], "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": r["text"]}
        else:
            choice["text"] = r["text"]
        choices.append(choice)
    completion = sum(r["completion_tokens"] for r in samples)
    usage = {"prompt_tokens": first["prompt_tokens"], "completion_tokens": completion,
             "total_tokens": first["prompt_tokens"] + completion}
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{first['row_index']}",
            "object": "chat.completion" if chat else "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage}
