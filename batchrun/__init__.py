"""batchrun: offline LLM batch inference with continuous batching over a paged KV cache."""
from batchrun.config import EngineConfig
from batchrun.engine.llm import LLM
from batchrun.engine.request import RequestOutput
from batchrun.job import Job
from batchrun.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "Job"]
