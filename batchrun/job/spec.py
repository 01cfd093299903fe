"""The job file: YAML in, a typed JobSpec out. Every error names the field and, where known, the line.

The sections' models are in sections.py; here the file is read (safe YAML, duplicate keys refused, --set
overrides), validated, and pydantic's errors are turned into messages with the field's line and a did-you-mean.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import os
import typing
from datetime import date, datetime
from typing import Literal

import yaml
from pydantic import ValidationError

from batchrun.config import EngineConfig
from batchrun.job.errors import JobError
from batchrun.deadline import parse_deadline
from batchrun.job.sections import (BatchingSection, EngineSection, ExecutorSection, InputSection, JobModel,
                                   KVQualityGateSection, OutputSection, SamplingSection, Section, StorageSection)
from batchrun.job.storage import Storage, StorageError, check_options, check_uri, is_uri, read_bytes
from batchrun.sampling_params import SamplingParams

# what changes the rows' contents (the job's identity): these sections, engine.deterministic and the fingerprints
# of engine.adapters' files; the other engine, batching and logging settings only change speed
IDENTITY = ("model", "input", "sampling", "deterministic", "adapters")


class JobSpec:
    name: str | None
    model: str
    deadline: str | int | datetime | None
    deadline_at: datetime | None   # the deadline as a local time, read when the job file is
    input: InputSection
    output: OutputSection
    sampling: SamplingSection
    engine: EngineSection
    batching: BatchingSection
    kv_quality_gate: KVQualityGateSection
    executor: ExecutorSection
    storage: StorageSection

    def __init__(self, raw: dict, path: str = "<dict>", lines: dict | None = None, base_dir: str = "."):
        self.path, self.lines, self.base_dir = path, lines or {}, base_dir
        try:
            job = JobModel.model_validate(_without_nulls(raw))
        except ValidationError as exc:
            raise self._explain(exc.errors()[0]) from None
        for section in JobModel.model_fields:
            setattr(self, section, getattr(job, section))
        self.model = self._resolve_model(self.model)
        self._check_paths()
        self._check_rules()
        self.deadline_at = self._read_deadline()

    @classmethod
    def from_yaml(cls, path: str, overrides: list[str] = ()) -> "JobSpec":
        try:
            with open(path) as f:
                text = f.read()
        except OSError as exc:
            raise JobError(f"{path}: cannot read the job file ({exc.strerror})") from exc
        try:
            raw = yaml.load(text, Loader=_UniqueKeyLoader) or {}   # SafeLoader plus a duplicate-key check
            lines = _line_map(text)
        except DuplicateKey as exc:
            raise JobError(f"{path}: {exc}") from None
        except yaml.YAMLError as exc:
            raise JobError(f"{path}: not valid YAML: {exc}") from exc
        if not isinstance(raw, dict):
            raise JobError(f"{path}: the job file must be a mapping of sections (model, input, sampling, output...)")
        for item in overrides:
            apply_override(raw, item, lines)
        return cls(raw, path, lines, os.path.dirname(os.path.abspath(path)))

    def set_executor_kind(self, kind: str, source: str) -> None:
        """executor.kind from outside the job file (Job.run(executor=...)); source names where it came from."""
        allowed = typing.get_args(ExecutorSection.model_fields["kind"].annotation)
        if kind not in allowed:
            raise JobError(f"{source}: unknown executor {kind!r}; allowed: {', '.join(allowed)}")
        self.executor = self.executor.model_copy(update={"kind": kind})

    def where(self, *key) -> str:
        line = self.lines.get(key)
        field = ".".join(key)
        # a line number in the job file, or the flag that set the field ("--set", "--max-tokens"...)
        return f"{self.path}: {field}" + (f" (line {line})" if isinstance(line, int) else
                                          f" (from {line})" if line else "")

    def fail(self, key: tuple, message: str) -> JobError:
        return JobError(f"{self.where(*key)}: {message}")

    def _explain(self, error: dict) -> JobError:
        """pydantic's first error as ours: the field path (line number added by fail), a message and a hint."""
        loc = error["loc"]
        top = JobModel.model_fields[loc[0]].annotation if loc and loc[0] in JobModel.model_fields else None
        model = top if isinstance(top, type) and issubclass(top, Section) else None
        key = tuple(loc[:2] if model else loc[:1])
        owner = model if len(key) == 2 else JobModel
        kind, value = error["type"], error.get("input")
        if kind == "extra_forbidden":
            return self.fail(key, f"unknown key{_did_you_mean(key[-1], owner.model_fields)}")
        if kind == "missing":
            return self.fail(key[:-1], f"{key[-1]} is required") if len(key) == 2 else \
                self.fail(key, "is required")
        if len(key) == 1 and model:   # a section that is not a mapping
            return self.fail(key, f"must be a mapping of {', '.join(model.model_fields)}")
        annotation = owner.model_fields[key[-1]].annotation
        if kind == "literal_error":
            return self.fail(key, f"unknown value {value!r}; allowed: {', '.join(_choices(annotation))}")
        if kind in ("greater_than", "greater_than_equal", "less_than_equal"):
            return self.fail(key, f"must be {_bound(error)}, got {value!r}")
        if kind.endswith("_type") or kind in ("int_from_float", "bool_parsing"):
            item = loc[len(key)] if len(loc) > len(key) and isinstance(loc[len(key)], int) else None
            shown = value.isoformat() if isinstance(value, (date, datetime)) else repr(value)
            got = f"item {item} is {shown}" if item is not None else f"got {shown}"
            return self.fail(key, f"must be {_describe(annotation)}, {got}")
        return self.fail(key, error["msg"].removeprefix("Value error, "))

    def _check_rules(self) -> None:
        """What one field's type cannot say: exclusive keys, a template's syntax, and EngineConfig's and
        SamplingParams' own range checks (so those live in one place)."""
        inp = self.input
        given = [k for k in ("prompt_column", "template", "messages_column") if getattr(inp, k)]
        if len(given) > 1:
            raise self.fail(("input", given[1]), f"give one of prompt_column, template, messages_column, not "
                                                 f"{' and '.join(given)}")
        if inp.system_prompt and not (inp.chat or inp.messages_column):
            raise self.fail(("input", "system_prompt"), "needs chat: true or a messages_column")
        if inp.template:
            try:
                fields = inp.template_columns
            except ValueError as exc:
                raise self.fail(("input", "template"), f"not a valid template ({exc}); use {{column}} "
                                                       f"placeholders and {{{{ }}}} for literal braces") from exc
            if not fields or any(not f.isidentifier() for f in fields):
                raise self.fail(("input", "template"), "needs {column} placeholders naming input columns")
        try:
            EngineConfig(model=self.model, **self.engine_options)
        except ValueError as exc:
            raise self._field_error("engine", exc) from exc
        self.adapter_fingerprints = self._fingerprint_adapters()
        ex, tp = self.executor, self.engine.tensor_parallel_size
        if ex.kind == "ray" and 0 < ex.gpus_per_replica < tp:
            raise self.fail(("executor", "gpus_per_replica"), f"{ex.gpus_per_replica:g} GPUs cannot hold the "
                                                              f"{tp} ranks of engine.tensor_parallel_size")
        self._read_schema_file()
        try:
            self.sampling_params()
        except ValueError as exc:
            field, _, message = str(exc).partition(": ")
            schema_file = self.sampling.json_schema_file
            if field == "json_schema" and schema_file:   # the schema came from a file: name the file
                raise self.fail(("sampling", "json_schema_file"), f"{self.resolve(schema_file)}: {message}") from None
            raise self._field_error("sampling", exc) from exc

    def _check_paths(self) -> None:
        """No credentials in a URI or in storage.options (they would reach job.json and the logs)."""
        try:
            check_options(self.storage.options)
        except StorageError as exc:
            raise JobError(f"{self.path}: {exc}") from None
        for key in (("input", "path"), ("output", "path"), ("sampling", "json_schema_file")):
            value = getattr(getattr(self, key[0]), key[1])
            if value and is_uri(value):
                try:
                    check_uri(value)
                except StorageError as exc:
                    raise self.fail(key, str(exc)) from None

    def _fingerprint_adapters(self) -> dict[str, str]:
        """engine.adapters' files, each checked as a PEFT LoRA adapter: name -> content hash."""
        adapters = self.engine_options.get("adapters") or {}
        if not adapters:   # the reader imports torch, which `batchrun status` must not
            return {}
        from batchrun.engine.lora.adapter_file import AdapterFile
        try:
            return {name: AdapterFile(name, path).fingerprint for name, path in adapters.items()}
        except ValueError as exc:
            raise self.fail(("engine", "adapters"), str(exc)) from None

    def _read_schema_file(self) -> None:
        """sampling.json_schema_file into sampling.json_schema (so the schema's text is part of the identity)."""
        name = self.sampling.json_schema_file
        if not name:
            return
        if self.sampling.json_schema is not None:
            raise self.fail(("sampling", "json_schema_file"), "give json_schema or json_schema_file, not both")
        try:
            self.sampling.json_schema = json.loads(read_bytes(self.resolve(name), self.storage.options))
        except OSError as exc:
            raise self.fail(("sampling", "json_schema_file"), f"cannot read {self.resolve(name)} "
                                                               f"({exc.strerror or exc})") from None
        except StorageError as exc:
            raise self.fail(("sampling", "json_schema_file"), f"cannot read {exc}") from None
        except ValueError as exc:
            raise self.fail(("sampling", "json_schema_file"), f"{self.resolve(name)} is not valid JSON "
                                                               f"({exc})") from None
        if not isinstance(self.sampling.json_schema, dict):
            found = {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}.get(
                type(self.sampling.json_schema), "null")
            self.sampling.json_schema = None
            raise self.fail(("sampling", "json_schema_file"), f"{self.resolve(name)} holds a JSON {found}, not a "
                                                               f"JSON schema (an object)")

    def _read_deadline(self) -> datetime | None:
        if self.deadline is None:
            return None
        if isinstance(self.deadline, int):   # YAML 1.1 reads an unquoted 07:00 as the number 420
            raise self.fail(("deadline",), f"write the time in quotes, e.g. deadline: \"07:00\" (YAML reads an "
                                           f"unquoted 07:00 as the number {self.deadline})")
        try:
            return parse_deadline(self.deadline)
        except ValueError as exc:
            raise self.fail(("deadline",), str(exc)) from None

    def _field_error(self, section: str, exc: ValueError) -> JobError:
        """'field: message' from EngineConfig or SamplingParams, placed at section.field."""
        field, _, message = str(exc).partition(": ")
        return self.fail((section, field), message)

    def sampling_params(self, **row) -> SamplingParams:
        """The job's SamplingParams, with a row's own values (None: not given) over the sampling section."""
        return SamplingParams(**{**self.sampling.model_dump(exclude={"json_schema_file"}),
                                 **{k: v for k, v in row.items() if v is not None}})

    def _resolve_model(self, model: str) -> str:
        """A model directory relative to the job file (as every path in it); a hub id or embedded name as given."""
        beside = os.path.join(self.base_dir, model)
        return os.path.normpath(beside) if not os.path.isabs(model) and os.path.isdir(beside) else model

    def resolve(self, path: str) -> str:
        """A path relative to the job file made absolute; a URI as it is."""
        if is_uri(path):
            return path
        path = path[len("file://"):] if path.lower().startswith("file://") else path
        return path if os.path.isabs(path) else os.path.normpath(os.path.join(self.base_dir, path))

    def output_storage(self) -> Storage:
        """output.path as a Storage (a local directory or a URI, opened with storage.options)."""
        return Storage(self.resolve(self.output.path), self.storage.options)

    @property
    def engine_options(self) -> dict:
        """The EngineConfig options the job sets (the others keep EngineConfig's defaults); adapter directories
        relative to the job file."""
        options = self.engine.model_dump(exclude_unset=True, exclude={"lane"})
        if options.get("adapters"):
            options["adapters"] = {name: self.resolve(path) for name, path in options["adapters"].items()}
        return options

    def identity_fields(self) -> dict:
        """What decides the rows' contents: model, input (its path made absolute), sampling, the adapters' file
        hashes, and deterministic mode where it is on (absent when off, so jobs written before the mode existed
        keep their identity)."""
        fields = {"model": self.model, "input": self.input.model_dump(), "sampling": self.sampling.model_dump()}
        if self.adapter_fingerprints:   # absent without adapters: the identity of jobs without them is unchanged
            fields["adapters"] = self.adapter_fingerprints
        fields["input"]["path"] = self.resolve(self.input.path)
        if self.engine.deterministic:   # a resumed job must not mix rows of both modes
            fields["deterministic"] = True
        return fields

    def identity(self) -> str:
        """Hash of the identity fields; engine and batching settings may change between runs of one job."""
        return hashlib.sha256(json.dumps(self.identity_fields(), sort_keys=True, default=str).encode()).hexdigest()[:16]


class DuplicateKey(yaml.YAMLError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, refusing a key given twice in one mapping (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise DuplicateKey(f"{key} is given twice (lines {seen[key]} and {line}); keep one")
            seen[key] = line
        return super().construct_mapping(node, deep)


def _without_nulls(raw: dict) -> dict:
    """A key set to null (or an empty section) means 'not set': the default applies."""
    return {k: ({kk: vv for kk, vv in v.items() if vv is not None} if isinstance(v, dict) else v)
            for k, v in raw.items() if v is not None}


def _did_you_mean(key: str, allowed) -> str:
    close = difflib.get_close_matches(key, list(allowed), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else f"; allowed: {', '.join(allowed)}"


def _choices(annotation) -> list[str]:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if len(args) == 1 and typing.get_origin(args[0]) is Literal:
        args = typing.get_args(args[0])
    return [str(a) for a in args]


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true/false", list: "a list",
               dict: "a mapping", datetime: "a date-time such as 2030-01-31T06:00"}


def _describe(annotation) -> str:
    """'an integer', 'a string or an integer', 'a list of strings'... for an error message."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _describe(args[0])
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if origin is list and args:
        return f"a list of {_describe(args[0]).removeprefix('a ').removeprefix('an ')}s"
    if args and origin is not list:   # a union: None means 'not set', not a type to ask for
        return " or ".join(_describe(a) for a in args if a is not type(None))
    return _TYPE_NAMES.get(origin or annotation, str(annotation))


def _bound(error: dict) -> str:
    ctx = error.get("ctx", {})
    if error["type"] == "greater_than" and ctx.get("gt") == 0:
        return "a positive integer"
    if "ge" in ctx and "le" in ctx:
        return f"in [{ctx['ge']}, {ctx['le']}]"
    return {"greater_than": f"> {ctx.get('gt')}", "greater_than_equal": f">= {ctx.get('ge')}",
            "less_than_equal": f"<= {ctx.get('le')}"}[error["type"]]


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
