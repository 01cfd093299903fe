"""What the planner plans for: the job's requests (prompt token lengths from the model's tokenizer, output lengths
from max_tokens) and the model's shape (from its Hugging Face config, no weights loaded)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from batchrun.job.prepare import encoded_rows
from batchrun.job.spec import JobSpec
from batchrun.stepmodel.costmodel import ModelSpec
from batchrun.stepmodel.simulate import WorkItem, admission_keys


@dataclass
class Workload:
    items: list[WorkItem]
    keys: list[tuple]            # admission order keys, as the job runner would give them
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    prefix_caching: bool
    rows_failing: int = 0        # rows that would fail before generation (empty prompt, too long...)

    @property
    def output_tokens(self) -> int:
        return sum(i.output_tokens for i in self.items)


def read_model_config(source: str, trust_remote_code: bool = False, field: str = "model") -> ModelSpec:
    """A model name/directory (resolved as the engine resolves it) or a config.json path -> ModelSpec."""
    try:
        if source.endswith(".json") and os.path.isfile(source):
            with open(source) as f:
                return ModelSpec.from_config(json.load(f), os.path.basename(os.path.dirname(source)) or source)
        from transformers import AutoConfig
        from batchrun.engine.loader import resolve_model_path
        config = AutoConfig.from_pretrained(resolve_model_path(source), trust_remote_code=trust_remote_code)
        return ModelSpec.from_config(config, source)
    except (OSError, ValueError, json.JSONDecodeError) as exc:
        message = str(exc).removeprefix(f"{field}: ").removeprefix("model: ")
        raise ValueError(f"{field}: cannot read the model config of {source!r} ({message})") from exc


def engine_settings(spec: JobSpec, max_num_seqs: int | None = None) -> dict:
    engine = spec.engine
    if max_num_seqs is not None and (not isinstance(max_num_seqs, int) or max_num_seqs < 1):
        raise ValueError(f"--max-num-seqs: must be a positive integer, got {max_num_seqs!r}")
    return {"block_size": engine.block_size, "max_num_seqs": max_num_seqs or engine.max_num_seqs,
            "max_num_batched_tokens": engine.max_num_batched_tokens, "prefix_caching": engine.enable_prefix_caching}


def load_workload(spec: JobSpec, model: ModelSpec, max_num_seqs: int | None = None,
                  keep_token_ids: bool = True) -> Workload:
    """Tokenize the job's prompts as `batchrun validate` does (no model load); output length = max_tokens."""
    from batchrun.engine.loader import load_tokenizer, resolve_model_path
    engine = spec.engine
    try:
        tokenizer = load_tokenizer(engine.tokenizer or resolve_model_path(spec.model), engine.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise spec.fail(("model",), f"cannot load the tokenizer ({exc})") from exc
    if tokenizer is None:
        raise spec.fail(("model",), "has no tokenizer files: the planner needs them to measure prompt lengths")
    context = min(engine.max_model_len or model.max_context, model.max_context)
    items, failing = [], 0
    for row in encoded_rows(spec, tokenizer, context):
        if row.error:
            failing += 1
            continue
        out = min(row.params.max_tokens, context - len(row.token_ids))
        items.append(WorkItem(tuple(row.token_ids) if keep_token_ids else len(row.token_ids), out))
    if not items:
        raise spec.fail(("input",), f"no row would run (rows failing before generation: {failing})")
    batching, settings = spec.batching, engine_settings(spec, max_num_seqs)
    keys = admission_keys(items, batching.bucketing, batching.window, batching.longest_first, batching.pilot)
    return Workload(items, keys, **settings, rows_failing=failing)
