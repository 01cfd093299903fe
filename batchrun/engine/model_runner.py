"""Owns the model and its KV pool; turns a StepPlan into one forward and the logits to sample from."""
from __future__ import annotations

import torch

from batchrun.engine.attention import AttentionMetadata, PrefillChunk
from batchrun.engine.request import Request
from batchrun.engine.scheduler import StepPlan


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, kv_dtype: torch.dtype, device: torch.device):
        attn = model.model.layers[0].self_attn
        self.model = model
        self.block_size = block_size
        self.device = device
        # One preallocated pool: [K/V, layer, block, slot in block, kv head, head dim].
        self.kv_pool = torch.zeros(2, len(model.model.layers), num_blocks, block_size, attn.num_kv_heads,
                                   attn.head_dim, dtype=kv_dtype, device=device)
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.k_cache, layer.self_attn.v_cache = self.kv_pool[0, i], self.kv_pool[1, i]

    def _slots(self, request: Request, start: int, end: int) -> list[int]:
        bs, table = self.block_size, request.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> tuple[torch.Tensor, list[Request]]:
        """Forward the planned tokens; returns logits [S, vocab] for the S requests that sample this step."""
        # Decodes (one new token) first, so their rows form one vectorised block.
        decodes = [(r, n) for r, n in plan.scheduled if n == 1]
        prefills = [(r, n) for r, n in plan.scheduled if n > 1]
        input_ids, positions, slots, prefill_chunks, sample_rows, sample_reqs = [], [], [], [], [], []
        for request, n in decodes + prefills:
            start = request.num_computed_tokens
            if n > 1:
                prefill_chunks.append(PrefillChunk(len(input_ids), n, start + n,
                                                   torch.tensor(request.block_table, device=self.device)))
            input_ids.extend(request.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            slots.extend(self._slots(request, start, start + n))
            if start + n == request.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sample_reqs.append(request)
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, device=self.device), num_decodes=len(decodes),
                                 prefills=prefill_chunks)
        if decodes:
            width = max(len(r.block_table) for r, _ in decodes)
            meta.decode_block_tables = torch.tensor([r.block_table + [0] * (width - len(r.block_table))
                                                     for r, _ in decodes], device=self.device)
            meta.decode_context_lens = torch.tensor([r.num_computed_tokens + 1 for r, _ in decodes],
                                                    device=self.device)
        logits = self.model(torch.tensor(input_ids, device=self.device),
                            torch.tensor(positions, device=self.device), meta,
                            torch.tensor(sample_rows, device=self.device, dtype=torch.long))
        return logits, sample_reqs
