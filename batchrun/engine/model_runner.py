"""Owns the model and its KV pools (one per lane); turns a StepPlan into one forward and the logits to sample from."""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from batchrun.attention_metadata import AttentionMetadata, DecodeGroup, PrefillChunk, Segment
from batchrun.engine.kv_cache import KVPool
from batchrun.engine.request import Request
from batchrun.engine.shared_prefix import find_shared_prefixes
from batchrun.engine.sampler import token_logprobs
from batchrun.engine.scheduler import StepPlan
from batchrun.kernels import quant
from batchrun.engine.lora import projection as lora
from batchrun.sampling_params import SamplingParams


class StepInputs(NamedTuple):
    """One forward's arguments: the step's token ids, their positions, the attention segments (one per KV pool) and
    the rows whose logits are sampled."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    segments: list[Segment]
    logits_indices: torch.Tensor


# A decode group is split when padding it to its longest context would add more than this fraction of its
# real tokens (and more than PAD_TOKENS): less copying, at the price of a few more, smaller matrix products.
PAD_SLACK = 0.25
PAD_TOKENS = 2048


class ModelRunner:
    def __init__(self, model, block_size: int, device: torch.device, adapters=None):
        self.model = model
        self.block_size = block_size
        self.device = device
        self.pools: list[KVPool] = []
        self.adapters = adapters   # lora.AdapterSet, or None: no request runs under an adapter

    def allocate_kv(self, pools: list[tuple[int, torch.dtype]]) -> None:
        """One KV pool per lane: (number of blocks, storage dtype)."""
        attn = self.model.model.layers[0].self_attn
        self.pools = []   # release the previous pools before allocating new ones
        self.pools = [KVPool(len(self.model.model.layers), num_blocks, self.block_size, attn.num_kv_heads,
                             attn.head_dim, dtype, self.device) for num_blocks, dtype in pools]
        # int8 keeps one scale per token and head, so a few outlier channels cost the others precision: rotate
        # K/V first (fp8 is floating point, its relative error does not depend on outliers; measured no gain).
        rotations = [quant.rotation(attn.head_dim, self.device, self.model.dtype) if dtype == torch.int8
                     else None for _, dtype in pools]
        for i, layer in enumerate(self.model.model.layers):
            layer.self_attn.kv_caches = [pool.layer(i) for pool in self.pools]
            layer.self_attn.kv_rotations = rotations

    def copy_blocks(self, pool: int, pairs: list[tuple[int, int]]) -> None:
        """Copy KV blocks (source, destination) within one lane's pool: a forked sample's partial last block."""
        self.pools[pool].copy_blocks(pairs)

    def dummy_forward(self, num_tokens: int, num_seqs: int, kv_dtype: torch.dtype) -> None:
        """One forward at the largest step the scheduler may plan (for memory profiling), on a scratch pool."""
        num_seqs = max(1, min(num_seqs, num_tokens))
        per_seq = num_tokens // num_seqs
        blocks_per_seq = -(-per_seq // self.block_size)
        self.allocate_kv([(num_seqs * blocks_per_seq, kv_dtype)])
        plan = StepPlan()
        for i in range(num_seqs):
            request = Request(f"profile-{i}", [0] * per_seq, SamplingParams(max_tokens=1))
            request.block_table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
            plan.scheduled.append((request, per_seq))
        self.run(plan, lambda request: 0)
        self.allocate_kv([])

    def _slots(self, request: Request, start: int, end: int) -> list[int]:
        bs, table = self.block_size, request.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _decode_groups(self, requests: list[Request]) -> list[DecodeGroup]:
        """Split decodes (sorted by context length) where padding to the group's longest would waste too much
        (only for backends that pad; the others take all decodes as one group)."""
        if not self.model.model.layers[0].self_attn.backend.pads_decodes:
            return [self._decode_group(requests, 0, len(requests))] if requests else []
        groups, start, total = [], 0, 0
        for i, request in enumerate(requests):
            length = request.num_computed_tokens + 1
            padded = length * (i - start + 1)
            if i > start and padded - (total + length) > max(PAD_SLACK * (total + length), PAD_TOKENS):
                groups.append(self._decode_group(requests, start, i))
                start, total = i, 0
            total += length
        if requests:
            groups.append(self._decode_group(requests, start, len(requests)))
        return groups

    def _decode_group(self, requests: list[Request], start: int, end: int) -> DecodeGroup:
        tables = [r.block_table for r in requests[start:end]]
        width = max(map(len, tables))
        lens = [r.num_computed_tokens + 1 for r in requests[start:end]]
        group = DecodeGroup(start, end, torch.tensor([t + [0] * (width - len(t)) for t in tables], device=self.device),
                            torch.tensor(lens, device=self.device), max(lens))
        if self.model.model.layers[0].self_attn.backend.reads_shared_prefixes:
            group.shared_prefixes, group.own_starts = find_shared_prefixes(tables, lens, self.block_size, self.device)
        return group

    def _span(self, request: Request, n: int) -> tuple[Request, int, int]:
        """(request, first position, tokens) to compute: the planned n tokens, or the whole request again where the
        model's cached keys no longer hold (LongRoPE past its original context; the blocks are already allocated)."""
        if self.model.must_recompute(request.num_computed_tokens, request.num_tokens):
            return request, 0, request.num_tokens
        return request, request.num_computed_tokens, n

    def run(self, plan: StepPlan, pool_of: Callable[[Request], int]) -> tuple[torch.Tensor, list[Request]]:
        """Forward the planned tokens; returns logits [S, vocab] for the S requests that sample this step. Prompt
        tokens scored this step (SamplingParams.prompt_logprobs) go onto their requests' prompt_logprobs."""
        inputs, sample_reqs, row_adapters, scored = self.prepare(plan, pool_of)
        with lora.step(self.adapters.update(row_adapters) if self.adapters is not None else None):
            logits = self.execute(inputs)
        if not scored.requests:
            return logits, sample_reqs
        scored.record(token_logprobs(logits[len(sample_reqs):], scored.targets(self.device)))
        return logits[:len(sample_reqs)], sample_reqs

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        return self.model(*inputs)

    def prepare(self, plan: StepPlan, pool_of: Callable[[Request], int]
                ) -> tuple[StepInputs, list[Request], list[str | None], "PromptScoring"]:
        """The forward's inputs for the plan (what a tensor-parallel rank 0 sends its workers), the requests that
        sample, in the order of the logits rows, each token row's adapter, and the prompt positions whose next
        token is scored (their logits rows follow the sampled ones)."""
        input_ids, positions, sample_rows, sample_reqs, segments, row_adapters = [], [], [], [], [], []
        scored = PromptScoring()
        for pool in sorted({pool_of(r) for r, _ in plan.scheduled}):
            scheduled = [self._span(r, n) for r, n in plan.scheduled if pool_of(r) == pool]
            # Decodes (one new token) first, by context length, so their rows form a few vectorised groups; each
            # adapter's decodes and prefills contiguous, so its LoRA update is one product pair per run.
            decodes = sorted(((r, s, n) for r, s, n in scheduled if n == 1), key=lambda rsn: (_adapter(rsn), rsn[1]))
            prefills = sorted(((r, s, n) for r, s, n in scheduled if n > 1), key=_adapter)
            seg_start, slots, chunks = len(input_ids), [], []
            for request, start, n in decodes + prefills:
                if n > 1:
                    chunks.append(PrefillChunk(len(input_ids) - seg_start, n, start + n,
                                               torch.tensor(request.block_table, device=self.device)))
                input_ids.extend(request.token_ids[start:start + n])
                row_adapters.extend([request.adapter] * n)
                offset = self.model.rope_offset(request.num_tokens)
                positions.extend(range(start + offset, start + n + offset))
                slots.extend(self._slots(request, start, start + n))
                if start + n == request.num_tokens:
                    sample_rows.append(len(input_ids) - 1)
                    sample_reqs.append(request)
                if request.params.prompt_logprobs:
                    scored.add(request, start, n, first_row=len(input_ids) - n)
            meta = AttentionMetadata(slot_mapping=torch.tensor(slots, device=self.device),
                                     decode_groups=self._decode_groups([r for r, _, _ in decodes]), prefills=chunks)
            segments.append(Segment(seg_start, len(input_ids), pool, meta))
        inputs = StepInputs(torch.tensor(input_ids, device=self.device), torch.tensor(positions, device=self.device),
                            segments, torch.tensor(sample_rows + scored.rows, device=self.device, dtype=torch.long))
        return inputs, sample_reqs, row_adapters, scored


class PromptScoring:
    """The prompt positions of a step whose next prompt token is scored (SamplingParams.prompt_logprobs): each
    position not scored before (a recompute after preemption skips those), up to the prompt's second-last token."""

    def __init__(self):
        self.rows: list[int] = []
        self.target_ids: list[int] = []
        self.requests: list[tuple[Request, int]] = []   # (request, how many of the rows are its)

    def add(self, request: Request, start: int, n: int, first_row: int) -> None:
        first = max(start, len(request.prompt_logprobs))
        last = min(start + n, request.num_prompt_tokens - 1)
        if first >= last:
            return
        self.rows.extend(range(first_row + first - start, first_row + last - start))
        self.target_ids.extend(request.prompt_token_ids[first + 1:last + 1])
        self.requests.append((request, last - first))

    def targets(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(self.target_ids, device=device, dtype=torch.long)

    def record(self, values: list[float]) -> None:
        """Each request's share of the scored rows' logprobs, appended to its prompt_logprobs."""
        at = 0
        for request, count in self.requests:
            request.prompt_logprobs.extend(values[at:at + count])
            at += count


def _adapter(scheduled: tuple[Request, int, int]) -> str:
    return scheduled[0].adapter or ""
