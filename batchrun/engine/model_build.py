"""Build a model from its checkpoint for one device: on the meta device first, then the weights assigned (only the
rank's slices under tensor parallelism), RoPE tables, oneDNN packing and the whole-model graph on the CPU."""
from __future__ import annotations

import logging

import torch

from batchrun.config import EngineConfig
from batchrun.engine import loader
from batchrun.engine.backends import get_backend
from batchrun.models import cpu_gemm, graph
from batchrun.models.registry import model_class

log = logging.getLogger("batchrun")


def build_model(config: EngineConfig, model_path: str, hf_config, device: torch.device, dtype: torch.dtype,
                max_model_len: int, shard=None):
    """The model ready to run; `shard` (engine/parallel/shard.py): this rank's slice of every split layer."""
    with torch.device("meta"):
        model = model_class(hf_config.model_type)(hf_config, get_backend(config.attention_backend, device))
    if shard is not None:
        shard.split(model)
    model.load_state_dict(loader.load_weights(model_path, device, dtype, model.checkpoint_plan,
                                              shard.part if shard is not None else None), assign=True)
    if shard is not None:
        shard.after_load(model)
    model.init_rope(max_model_len, device, dtype)
    model.eval()
    if device.type == "cpu" and model.pack_for_cpu():
        log.info("linear layers: oneDNN with pre-packed weights (%s)", str(dtype).removeprefix("torch."))
    if device.type == "cpu":
        # The loader's read buffers (float32 checkpoint rows converted to the compute dtype) and the dense
        # weights packing replaced are free but stay resident in glibc's heap until trimmed: 0.4-0.7x the weights.
        cpu_gemm.return_freed_memory(now=True)
    if device.type == "cpu" and graph.enabled() and model.whole_graph:
        model.compile_graph()
        log.info("forward: one torch.compile graph (compiled at the first steps; BATCHRUN_COMPILE=ops: per op)")
    return model
