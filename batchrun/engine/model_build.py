"""Build a model from its checkpoint for one device: on the meta device first, then the weights assigned (quantized
as they load where a scheme says so; only the rank's slices under tensor parallelism), RoPE tables, LoRA adapters
checked and wrapped, oneDNN packing, deterministic mode's product tiles and the whole-model graph on the CPU."""
from __future__ import annotations

import logging

import torch

from batchrun.config import EngineConfig
from batchrun.engine import deterministic, loader
from batchrun.engine.backends import get_backend
from batchrun.engine.lora import AdapterSet
from batchrun.kernels import amx_linear
from batchrun.models import cpu_gemm, graph, row_tiles
from batchrun.models.registry import model_class
from batchrun.quant import load as quant_load

log = logging.getLogger("batchrun")


def build_model(config: EngineConfig, model_path: str, hf_config, device: torch.device, dtype: torch.dtype,
                max_model_len: int, shard=None, quant_scheme=None) -> tuple[torch.nn.Module, AdapterSet | None]:
    """The model ready to run and its adapter set (None without adapters). `shard` (engine/parallel/shard.py):
    this rank's slice of every split layer; `quant_scheme` (quant/formats.py): how its projections are quantized."""
    with torch.device("meta"):
        model = model_class(hf_config.model_type)(hf_config, get_backend(config.attention_backend, device,
                                                                          config.deterministic))
    if shard is not None:
        shard.split(model)
    plan, build = quant_load.plan_and_build(model, quant_scheme, device, dtype)
    model.load_state_dict(loader.load_weights(model_path, device, dtype, plan, build=build,
                                              part=shard.part if shard is not None else None), assign=True)
    if shard is not None:
        shard.after_load(model)
    if quant_scheme is not None:
        log.info("weights: %s", quant_scheme.description)
    model.init_rope(max_model_len, device, dtype)
    model.eval()
    # Every adapter file is checked against the model here, before any work; each is loaded at first use.
    adapters = AdapterSet(config.adapters, model, dtype, device, config.max_adapters) if config.adapters else None
    packed = device.type == "cpu" and model.pack_for_cpu()
    if packed:
        products = "AMX tiles (batchrun's kernel)" if dtype == torch.bfloat16 and amx_linear.available() else "oneDNN"
        log.info("linear layers: %s with pre-packed weights (%s)", products, str(dtype).removeprefix("torch."))
    if config.deterministic:
        deterministic.tile_products(model, row_tiles.DEFAULT_TILE)
        log.info("deterministic mode: products on tiles of %d rows, every attention row a decode of its own",
                 row_tiles.DEFAULT_TILE)
    if device.type == "cpu":
        # The loader's read buffers (float32 checkpoint rows converted to the compute dtype) and the dense
        # weights packing replaced are free but stay resident in glibc's heap until trimmed: 0.4-0.7x the weights.
        cpu_gemm.return_freed_memory(now=True)
    # Unpacked weights tile in Python over a step-dependent row count, which the whole-model graph cannot trace.
    if device.type == "cpu" and graph.enabled() and model.whole_graph and (packed or not config.deterministic):
        model.compile_graph()
        log.info("forward: one torch.compile graph (built by a warm-up at start-up; BATCHRUN_COMPILE=ops: per op)")
    return model, adapters
