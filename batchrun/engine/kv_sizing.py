"""How many KV blocks each lane's pool gets: from kv_cache_memory, or on CUDA from a profiled peak step."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from batchrun.config import EngineConfig

log = logging.getLogger("batchrun")

DEFAULT_CPU_KV_BYTES = 2 * 2**30
DEFAULT_INTERACTIVE_SHARE = 1 / 8


def total_kv_budget(config: EngineConfig, device: torch.device, profile_peak) -> tuple[int, str]:
    """(bytes, the config field that sets them). `profile_peak()` runs the largest step, on CUDA only."""
    if config.kv_cache_bytes is None and device.type == "cuda":
        return _cuda_budget(config, device, profile_peak), "gpu_memory_utilization"
    return config.kv_cache_bytes or DEFAULT_CPU_KV_BYTES, "kv_cache_memory"


def _cuda_budget(config: EngineConfig, device: torch.device, profile_peak) -> int:
    """total x utilisation - (weights + activations at the largest step) - memory of other processes."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile_peak()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    others = total - free - torch.cuda.memory_reserved(device)
    budget = int(total * config.gpu_memory_utilization - peak - others)
    log.info("CUDA memory: total %.1f GiB, peak of weights + largest step %.2f GiB, other processes %.2f GiB, "
             "KV budget %.2f GiB at utilisation %.2f", total / 2**30, peak / 2**30, others / 2**30,
             budget / 2**30, config.gpu_memory_utilization)
    return max(budget, 0)


def split_interactive(config: EngineConfig, budget: int) -> tuple[int, int]:
    """(batch bytes, interactive bytes): the interactive lane's pool is a reserve carved out of the budget."""
    if not config.interactive_lane:
        return budget, 0
    interactive = config.interactive_kv_bytes or int(budget * DEFAULT_INTERACTIVE_SHARE)
    if interactive >= budget:
        raise ValueError(f"interactive_kv_memory: {interactive / 2**20:.1f} MiB leaves nothing of the "
                         f"{budget / 2**20:.1f} MiB KV budget to the batch lane")
    return budget - interactive, interactive


@dataclass(frozen=True)
class LaneSpec:
    """A lane as configured, before its pool is sized."""
    name: str
    kv_bytes: int                # its share of the KV budget
    kv_dtype: str                # as configured ("auto": the compute dtype's)
    max_num_seqs: int
    token_cap: int               # tokens it may compute in one step
    budget_field: str            # the option that sets its budget, for error messages
    yield_cap: int | None = None  # its token cap while a higher lane has requests


def lane_specs(config: EngineConfig, budget: int, field: str) -> list[LaneSpec]:
    """The engine's lanes, highest first: the interactive lane where enabled, then the batch lane; `budget` (set by
    the config's `field`) split between them."""
    batch_bytes, interactive_bytes = split_interactive(config, budget)
    specs = [LaneSpec("batch", batch_bytes, config.kv_cache_dtype, config.max_num_seqs,
                      config.max_num_batched_tokens, field, yield_cap=config.batch_tokens_while_interactive)]
    if config.interactive_lane:
        specs.insert(0, LaneSpec("interactive", interactive_bytes, config.interactive_kv_cache_dtype,
                                 config.interactive_max_num_seqs,
                                 max(1, int(config.max_num_batched_tokens * config.interactive_token_share)),
                                 "interactive_kv_memory"))
    return specs


def blocks_for(budget: int, bytes_per_token: int, block_size: int, max_model_len: int, field: str,
               dtype_name: str) -> int:
    """Blocks that fit the budget; an error naming the field when one request at max context does not fit."""
    block_bytes = bytes_per_token * block_size
    num_blocks = budget // block_bytes
    needed = -(-max_model_len // block_size)
    if num_blocks < needed:
        raise ValueError(
            f"{field}: the KV budget of {budget / 2**20:.1f} MiB holds {num_blocks * block_size} tokens "
            f"of {dtype_name} KV ({bytes_per_token} bytes/token), less than one request at max context "
            f"({max_model_len} tokens, {needed * block_bytes / 2**20:.1f} MiB); raise {field} "
            f"or lower max_model_len to at most {num_blocks * block_size}")
    return num_blocks
