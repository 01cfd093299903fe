"""batchrun: offline LLM batch inference with continuous batching over a paged KV cache.

The public names are imported on first use, so that commands that never load a model (status, validate, schema)
start without importing torch's compiler stack.
"""
import importlib

_PUBLIC = {"LLM": "batchrun.engine.llm", "SamplingParams": "batchrun.sampling_params",
           "EngineConfig": "batchrun.config", "RequestOutput": "batchrun.engine.request", "Job": "batchrun.job",
           "plan": "batchrun.planner.api"}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'batchrun' has no attribute {name!r}")
