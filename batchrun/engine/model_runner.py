"""Owns the model and its KV pool; turns a StepPlan into one forward and the logits to sample from."""
from __future__ import annotations

import torch

from batchrun.engine.attention import AttentionMetadata, PrefillChunk
from batchrun.engine.kv_cache import KVPool
from batchrun.engine.request import Request
from batchrun.engine.scheduler import StepPlan
from batchrun.sampling_params import SamplingParams


class ModelRunner:
    def __init__(self, model, block_size: int, kv_dtype: torch.dtype, device: torch.device):
        self.model = model
        self.block_size = block_size
        self.kv_dtype = kv_dtype
        self.device = device
        self.kv_pool: KVPool | None = None

    def allocate_kv(self, num_blocks: int) -> None:
        attn = self.model.model.layers[0].self_attn
        self.kv_pool = None   # release the previous pool before allocating the new one
        self.kv_pool = KVPool(len(self.model.model.layers), num_blocks, self.block_size, attn.num_kv_heads,
                              attn.head_dim, self.kv_dtype, self.device)
        for i, layer in enumerate(self.model.model.layers):
            layer.self_attn.kv_cache = self.kv_pool.layer(i)

    def dummy_forward(self, num_tokens: int, num_seqs: int) -> None:
        """One forward at the largest step the scheduler may plan (for memory profiling), on a scratch pool."""
        num_seqs = max(1, min(num_seqs, num_tokens))
        per_seq = num_tokens // num_seqs
        blocks_per_seq = -(-per_seq // self.block_size)
        self.allocate_kv(num_seqs * blocks_per_seq)
        plan = StepPlan()
        for i in range(num_seqs):
            request = Request(f"profile-{i}", [0] * per_seq, SamplingParams(max_tokens=1))
            request.block_table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
            plan.scheduled.append((request, per_seq))
        self.run(plan)
        self.allocate_kv(0)

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
