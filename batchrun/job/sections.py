"""The job file's sections as pydantic models: unknown keys refused, types, defaults and choices declared once.

The engine and sampling sections are built from EngineConfig and SamplingParams (their fields, types and
defaults), whose own checks give the ranges, so a new engine or sampling option needs no change here. `batchrun
schema` exports the JSON Schema of JobModel.
"""
from __future__ import annotations

import dataclasses
import string
import typing
from datetime import datetime
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, create_model, field_validator, model_validator

from batchrun.config import EngineConfig
from batchrun.sampling_params import SamplingParams

# Deliberate differences from SamplingParams (vLLM's defaults, kept for the Python API): a nightly job is greedy and
# reproducible by default, with room for a real answer.
JOB_SAMPLING_DEFAULTS = {"max_tokens": 64, "temperature": 0.0}


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def section_from(cls, name: str, skip: tuple[str, ...] = (), defaults: dict | None = None, **extra) -> type[Section]:
    """A section whose keys are the dataclass's fields (same types and defaults), minus `skip`, plus `extra`."""
    hints, defaults = typing.get_type_hints(cls), defaults or {}
    fields = {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        if f.name in defaults:
            default = defaults[f.name]
        elif f.default_factory is not dataclasses.MISSING:
            default = Field(default_factory=f.default_factory)
        else:
            default = f.default
        fields[f.name] = (hints[f.name], default)
    return create_model(name, __base__=Section, **fields, **extra)


EngineSection = section_from(EngineConfig, "EngineSection", skip=("model",),
                             lane=(Literal["batch", "interactive"], "batch"))
# logprobs: the job's output has no column for them
SamplingSection = section_from(SamplingParams, "SamplingSection", skip=("logprobs", "prompt_logprobs"),
                               defaults=JOB_SAMPLING_DEFAULTS,
                               json_schema_file=(Optional[str], Field(None, description="a JSON schema file for "
                                                                      "the output, relative to the job file")))


class InputSection(Section):
    path: str
    format: Literal["auto", "parquet", "openai_batch"] = "auto"
    id_column: str = "id"
    prompt_column: Optional[str] = None
    template: Optional[str] = Field(None, description="a prompt from columns: 'Summarize: {article}'")
    messages_column: Optional[str] = None
    chat: bool = Field(False, description="wrap a plain prompt as a user message and apply the chat template")
    system_prompt: Optional[str] = None
    truncate: Literal["none", "left", "right"] = "none"
    max_tokens_column: Optional[str] = None
    temperature_column: Optional[str] = None
    top_p_column: Optional[str] = None
    seed_column: Optional[str] = None
    json_schema_column: Optional[str] = Field(None, description="a JSON schema (text) per row for its output")
    adapter_column: Optional[str] = Field(None, description="a LoRA adapter name (one of engine.adapters) per row; "
                                                            "null: sampling.adapter, else the base model")
    passthrough: list[str] = Field(default_factory=list, description="input columns copied to the output")
    limit: Optional[PositiveInt] = None
    allow_duplicate_ids: bool = False

    @model_validator(mode="after")
    def _fill_derived(self):
        if self.format == "auto":
            self.format = "openai_batch" if self.path.endswith((".jsonl", ".jsonl.gz")) else "parquet"
        if self.format == "parquet" and not (self.prompt_column or self.template or self.messages_column):
            self.prompt_column = "prompt"
        return self

    @property
    def template_columns(self) -> list[str]:
        """The columns the template names, in order (checked to be identifiers when the spec is read)."""
        if not self.template:
            return []
        return list(dict.fromkeys(f for _, f, _, _ in string.Formatter().parse(self.template) if f is not None))


class OutputSection(Section):
    path: str
    openai_batch: bool = Field(False, description="also write output.jsonl in the OpenAI Batch API format")
    order: Literal["finish", "input"] = "finish"
    shard_rows: PositiveInt = 256
    flush_every_s: float = 30.0
    log_every_s: float = 30.0
    parse_json: bool = Field(False, description="a json column with the parsed, validated output; an output "
                                                "that does not parse (or match its schema) fails its row")


class StorageSection(Section):
    """How URIs in input.path, output.path and sampling.json_schema_file are opened (credentials: the environment)."""
    options: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="filesystem options the environment cannot give, e.g. {region: eu-west-1} "
                                          "(pyarrow's S3FileSystem or GcsFileSystem keywords, or fsspec's for other "
                                          "schemes); no credentials")
    lock_lease_s: float = Field(60.0, ge=3, description="on an object store: how long the job's lock outlives a "
                                                       "crashed submit (renewed every third of it while the job runs)")


class KVQualityGateSection(Section):
    sample: int = Field(0, ge=0, description="prompts compared before the run (0: no gate)")
    # SmolLM2, 16 demo prompts x 64 tokens, both sides deterministic: int8 68.8 % / fp8 25.0 % identical at float32,
    # 37.5 % / 31.2 % at bfloat16 (README): 0.2 passes both at both dtypes and stops a broken quantization.
    min_identical: float = Field(0.2, ge=0, le=1)
    # A second floor that no early divergence cuts short: the sample prompts' teacher-forced log-likelihood per token
    # may drop by at most this much (nats) under the quantized precision. None: not gated.
    max_loglik_drop: Optional[float] = Field(None, ge=0)
    on_fail: Literal["stop", "fallback"] = "stop"
    fallback_dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"


class BatchingSection(Section):
    bucketing: bool = True
    longest_first: bool = False
    window: PositiveInt = 8192
    max_waiting: Optional[PositiveInt] = None
    pilot: float = Field(0.1, ge=0, le=1, description="with bucketing: the share of each prompt-length class "
                                                     "(powers of two; at least 4 rows) in the first window admitted "
                                                     "first, shortest first, so the time left learns early how far "
                                                     "each class's outputs run (0: none)")


class ExecutorSection(Section):
    """Where the job runs: this process (local) or a pool of engine replicas on Ray Data (ray)."""
    kind: Literal["local", "ray"] = "local"
    address: Optional[str] = Field(None, description="auto, ray://HOST:10001 or HOST:6379; unset: start a local Ray "
                                                     "on 127.0.0.1")
    replicas: int | list[int] = Field(1, description="engine replicas: a number, or [min, max] for an autoscaling "
                                                     "pool")
    gpus_per_replica: float = Field(0.0, ge=0)
    cpus_per_replica: float = Field(1.0, gt=0, description="also the replica's torch threads (rounded, at least 1)")
    max_batches_in_flight: PositiveInt = Field(4, description="batches queued in each replica's engine at once, so "
                                                              "its continuous batch does not drain between them")
    batch_size: PositiveInt = Field(64, description="rows per Ray batch; each batch is committed as one shard")
    accelerator_type: Optional[str] = Field(None, description="Ray accelerator type for the replicas, e.g. H100")
    shared_filesystem: bool = Field(False, description="input.path and output.path are on storage every node of a "
                                                       "multi-host cluster mounts at the same path (not needed "
                                                       "for URIs: s3://, gs://...)")

    @field_validator("replicas")
    @classmethod
    def _replicas_range(cls, value):
        bounds = value if isinstance(value, list) else [value]
        if len(bounds) not in (1, 2) or any(n < 1 for n in bounds) or bounds[0] > bounds[-1]:
            raise ValueError(f"must be a positive integer or [min, max] with 1 <= min <= max, got {value!r}")
        return value

    @property
    def replica_range(self) -> tuple[int, int]:
        return (self.replicas, self.replicas) if isinstance(self.replicas, int) else tuple(self.replicas)


class JobModel(Section):
    """A batchrun job file."""
    name: Optional[str] = None
    model: str = EngineConfig.model
    # datetime: YAML reads an unquoted 2030-01-31T06:00:00 as one
    deadline: Optional[str | int | datetime] = Field(None, description='"07:00" (the next 07:00) or a date-time '
                                                             '"2030-01-31T06:00": the progress says whether the job is '
                                                             'on track for it')
    input: InputSection
    output: OutputSection
    sampling: SamplingSection = Field(default_factory=SamplingSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    batching: BatchingSection = Field(default_factory=BatchingSection)
    kv_quality_gate: KVQualityGateSection = Field(default_factory=KVQualityGateSection)
    executor: ExecutorSection = Field(default_factory=ExecutorSection)
    storage: StorageSection = Field(default_factory=StorageSection)


def json_schema() -> dict:
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **JobModel.model_json_schema()}
