"""The job file: YAML in, a validated JobSpec out. Every error names the field and, where known, the line."""
from __future__ import annotations

import copy
import difflib
import hashlib
import json
import os
import string

import yaml

from batchrun.config import EngineConfig
from batchrun.job.errors import JobError
from batchrun.sampling_params import SamplingParams

_STR, _INT, _NUM, _BOOL, _LIST = (str,), (int,), (int, float), (bool,), (list,)
# section -> key -> (allowed types, default); None as a default means "not set"
SCHEMA: dict[str, dict[str, tuple]] = {
    "engine": {"kv_cache_memory": ((str, int), "2GiB"), "kv_cache_dtype": (_STR, None), "block_size": (_INT, None),
               "max_num_seqs": (_INT, None), "max_num_batched_tokens": (_INT, None), "max_model_len": (_INT, None),
               "enable_prefix_caching": (_BOOL, None), "device": (_STR, None), "dtype": (_STR, None),
               "seed": (_INT, None), "trust_remote_code": (_BOOL, None), "tokenizer": (_STR, None),
               "gpu_memory_utilization": (_NUM, None), "attention_backend": (_STR, None), "lane": (_STR, "batch"),
               "interactive_lane": (_BOOL, None), "interactive_kv_memory": ((str, int), None),
               "interactive_kv_cache_dtype": (_STR, None), "interactive_max_num_seqs": (_INT, None),
               "interactive_token_share": (_NUM, None), "batch_tokens_while_interactive": (_INT, None)},
    "input": {"path": (_STR, None), "format": (_STR, "auto"), "id_column": (_STR, "id"),
              "prompt_column": (_STR, None), "template": (_STR, None), "messages_column": (_STR, None),
              "chat": (_BOOL, False), "system_prompt": (_STR, None), "truncate": (_STR, "none"),
              "max_tokens_column": (_STR, None), "temperature_column": (_STR, None), "top_p_column": (_STR, None),
              "seed_column": (_STR, None), "passthrough": (_LIST, []), "limit": (_INT, None),
              "allow_duplicate_ids": (_BOOL, False)},
    "sampling": {"max_tokens": (_INT, 64), "temperature": (_NUM, 0.0), "top_p": (_NUM, 1.0), "top_k": (_INT, 0),
                 "seed": (_INT, None), "stop": ((str, list), None), "ignore_eos": (_BOOL, False)},
    "output": {"path": (_STR, None), "openai_batch": (_BOOL, False), "order": (_STR, "finish"),
               "shard_rows": (_INT, 256), "flush_every_s": (_NUM, 30.0), "log_every_s": (_NUM, 30.0)},
    "kv_quality_gate": {"sample": (_INT, 0), "min_identical": (_NUM, 0.9), "on_fail": (_STR, "stop"),
                        "fallback_dtype": (_STR, "auto")},
    "batching": {"bucketing": (_BOOL, True), "longest_first": (_BOOL, False), "window": (_INT, 8192),
                 "max_waiting": (_INT, None)},
}
TOP_LEVEL = {"name": (_STR, None), "model": (_STR, "smollm2-135m")}
CHOICES = {("input", "format"): ("auto", "parquet", "openai_batch"), ("input", "truncate"): ("none", "left", "right"),
           ("output", "order"): ("finish", "input"), ("kv_quality_gate", "on_fail"): ("stop", "fallback"),
           ("kv_quality_gate", "fallback_dtype"): ("auto", "float32", "float16", "bfloat16")}
POSITIVE = {("input", "limit"), ("output", "shard_rows"), ("batching", "window"), ("batching", "max_waiting"),
            ("sampling", "max_tokens")}
# sections that change what rows contain (the job's identity); engine, batching and logging only change speed
IDENTITY = ("model", "input", "sampling")


def _did_you_mean(key: str, allowed) -> str:
    close = difflib.get_close_matches(key, list(allowed), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else f"; allowed: {', '.join(allowed)}"


def _line_map(text: str) -> dict[tuple, int]:
    lines: dict[tuple, int] = {}

    def walk(node, path):
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                sub = path + (str(key.value),)
                lines[sub] = key.start_mark.line + 1
                walk(value, sub)
    walk(yaml.compose(text), ())
    return lines


class JobSpec:
    def __init__(self, raw: dict, path: str = "<dict>", lines: dict | None = None, base_dir: str = "."):
        self.path, self.lines, self.base_dir = path, lines or {}, base_dir
        self.data = self._validate(raw)

    @classmethod
    def from_yaml(cls, path: str, overrides: list[str] = ()) -> "JobSpec":
        try:
            with open(path) as f:
                text = f.read()
        except OSError as exc:
            raise JobError(f"{path}: cannot read the job file ({exc.strerror})") from exc
        try:
            raw = yaml.safe_load(text) or {}
            lines = _line_map(text)
        except yaml.YAMLError as exc:
            raise JobError(f"{path}: not valid YAML: {exc}") from exc
        if not isinstance(raw, dict):
            raise JobError(f"{path}: the job file must be a mapping of sections (model, input, sampling, output...)")
        for item in overrides:
            apply_override(raw, item, lines)
        return cls(raw, path, lines, os.path.dirname(os.path.abspath(path)))

    def where(self, *key) -> str:
        line = self.lines.get(key)
        field = ".".join(key)
        return f"{self.path}: {field}" + (f" (line {line})" if isinstance(line, int) else
                                          " (from --set)" if line == "--set" else "")

    def fail(self, key: tuple, message: str) -> JobError:
        return JobError(f"{self.where(*key)}: {message}")

    def _validate(self, raw: dict) -> dict:
        data: dict = {}
        for key in raw:
            if key not in TOP_LEVEL and key not in SCHEMA:
                raise self.fail((key,), f"unknown key{_did_you_mean(key, [*TOP_LEVEL, *SCHEMA])}")
        for key, (types, default) in TOP_LEVEL.items():
            data[key] = self._check((key,), raw.get(key, default), types)
        for section, fields in SCHEMA.items():
            given = raw.get(section) or {}
            if not isinstance(given, dict):
                raise self.fail((section,), f"must be a mapping of {', '.join(fields)}")
            for key in given:
                if key not in fields:
                    raise self.fail((section, key), f"unknown key{_did_you_mean(key, fields)}")
            data[section] = {k: self._check((section, k), given.get(k, copy.copy(d)), t)
                             for k, (t, d) in fields.items()}
        self._check_rules(data)
        return data

    def _check(self, key: tuple, value, types):
        if value is None:
            return None
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            names = "a number" if types == _NUM else " or ".join(
                {"str": "a string", "int": "an integer", "bool": "true/false", "list": "a list"}[t.__name__]
                for t in types)
            raise self.fail(key, f"must be {names}, got {value!r}")
        if key in CHOICES and value not in CHOICES[key]:
            raise self.fail(key, f"unknown value {value!r}; allowed: {', '.join(CHOICES[key])}")
        if key in POSITIVE and value <= 0:
            raise self.fail(key, f"must be a positive integer, got {value!r}")
        return value

    def _check_rules(self, data: dict) -> None:
        inp = data["input"]
        if not 0 <= data["kv_quality_gate"]["min_identical"] <= 1:
            raise self.fail(("kv_quality_gate", "min_identical"), "must be a fraction in [0, 1], got "
                                                                  f"{data['kv_quality_gate']['min_identical']!r}")
        for section, key in (("input", "path"), ("output", "path")):
            if not data[section][key]:
                raise self.fail((section,), f"{key} is required")
        if inp["format"] == "auto":
            inp["format"] = "openai_batch" if inp["path"].endswith((".jsonl", ".jsonl.gz")) else "parquet"
        given = [k for k in ("prompt_column", "template", "messages_column") if inp[k]]
        if len(given) > 1:
            raise self.fail(("input", given[1]), f"give one of prompt_column, template, messages_column, not "
                                                 f"{' and '.join(given)}")
        if inp["format"] == "parquet" and not given:
            inp["prompt_column"] = "prompt"
        if inp["system_prompt"] and not (inp["chat"] or inp["messages_column"]):
            raise self.fail(("input", "system_prompt"), "needs chat: true or a messages_column")
        if inp["template"]:
            try:
                fields = [f for _, f, _, _ in string.Formatter().parse(inp["template"]) if f is not None]
            except ValueError as exc:
                raise self.fail(("input", "template"), f"not a valid template ({exc}); use {{column}} "
                                                       f"placeholders and {{{{ }}}} for literal braces") from exc
            if not fields or any(not f.isidentifier() for f in fields):
                raise self.fail(("input", "template"), "needs {column} placeholders naming input columns")
            inp["template_columns"] = list(dict.fromkeys(fields))
        if any(not isinstance(c, str) for c in inp["passthrough"]):
            raise self.fail(("input", "passthrough"), "must be a list of column names")
        engine = {k: v for k, v in data["engine"].items() if v is not None and k != "lane"}
        try:
            EngineConfig(model=data["model"], **engine)
        except ValueError as exc:
            field = str(exc).split(":", 1)[0]
            raise self.fail(("engine", field), str(exc).split(": ", 1)[-1]) from exc
        self.sampling_params(data)

    def sampling_params(self, data: dict | None = None, **row) -> SamplingParams:
        s = dict((data or self.data)["sampling"])
        s.update({k: v for k, v in row.items() if v is not None})
        try:
            return SamplingParams(**{k: v for k, v in s.items() if v is not None})
        except ValueError as exc:
            field = str(exc).split(":", 1)[0]
            if row:
                raise
            raise self.fail(("sampling", field), str(exc).split(": ", 1)[-1]) from exc

    def resolve(self, path: str) -> str:
        return path if os.path.isabs(path) else os.path.normpath(os.path.join(self.base_dir, path))

    @property
    def engine_options(self) -> dict:
        return {k: v for k, v in self.data["engine"].items() if v is not None and k != "lane"}

    def identity(self) -> str:
        """Hash of what decides the rows' contents (model, input, sampling); engine and batching may change."""
        ident = {k: self.data[k] for k in IDENTITY}
        ident["input"] = {**ident["input"], "path": self.resolve(ident["input"]["path"])}
        return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]


def apply_override(raw: dict, item: str, lines: dict) -> None:
    """`section.key=value` (value parsed as YAML) into the raw spec, before validation."""
    if "=" not in item:
        raise JobError(f"--set {item!r}: expected key=value, e.g. --set input.limit=20")
    key, value = item.split("=", 1)
    parts = key.strip().split(".")
    target = raw
    for part in parts[:-1]:
        target = target.setdefault(part, {})
        if not isinstance(target, dict):
            raise JobError(f"--set {item!r}: {part} is not a section")
    try:
        target[parts[-1]] = yaml.safe_load(value)
    except yaml.YAMLError as exc:
        raise JobError(f"--set {item!r}: the value is not valid YAML ({exc})") from exc
    lines[tuple(parts)] = "--set"
