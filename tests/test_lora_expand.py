"""The CPU LoRA expand kernel (batchrun/kernels/lora_expand.cpp) against the dense product it replaces: each run of
rows gets its own adapter's update on the parts of a fused projection it adapts, base rows and columns no part
covers keep y, from row-strided views of one fused product, in float32, bfloat16 (odd ranks too) and float16."""
import pytest
import torch

from batchrun.engine.lora import grouped
from batchrun.engine.lora.targets import Weights
from batchrun.kernels import lora_expand

pytestmark = pytest.mark.skipif(lora_expand.load() is None, reason="the LoRA expand kernel could not be built here")


def adapter(out_features: int, parts: list[tuple[int, int, int]], seed: int) -> Weights:
    """Random weights on `parts` (first row, end row, rank) of an [out, in=8] projection: B block-diagonal."""
    g = torch.Generator().manual_seed(seed)
    ranks = sum(rank for *_, rank in parts)
    b, column = torch.zeros(out_features, ranks), 0
    for start, end, rank in parts:
        b[start:end, column:column + rank] = torch.randn(end - start, rank, generator=g)
        column += rank
    return Weights(torch.randn(ranks, 8, generator=g), b, tuple(parts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_expand_matches_the_masked_dense_product(dtype):
    # a fused projection of 3 parts (100, 70 and 30 rows: block tails of every size), adapters on different parts
    # with different ranks; the stack in resident order: 'a' all parts, 'b' the middle part only, 'c' the first
    # and last
    out_features = 200
    resident = {"a": {"p": adapter(out_features, [(0, 100, 4), (100, 170, 8), (170, 200, 2)], 1)},
                "b": {"p": adapter(out_features, [(100, 170, 16)], 2)},
                "c": {"p": adapter(out_features, [(0, 100, 3), (170, 200, 5)], 3)}}
    resident = {name: {"p": Weights(w.a.to(dtype), w.b.to(dtype), w.parts)} for name, ws in resident.items()
                for w in ws.values()}
    stack = grouped.build_stacks(resident, {"p": (8, out_features)}, pack=False, kernel=True)["p"]
    row_adapter = [None, "c", "c", "a", "a", "a", None, "b", "b", "c"]   # runs, base rows between them
    runs = torch.tensor([(1, 3, 2), (3, 6, 0), (7, 9, 1), (9, 10, 2)])
    columns = stack.a.shape[0]
    both = torch.randn(len(row_adapter), out_features + columns).to(dtype)   # one product: y then the shrink
    y, h = both[:, :out_features], both[:, out_features:]
    got = lora_expand.expand(y, h, stack.bt, stack.pieces, stack.first, runs)

    order = {name: i for i, name in enumerate(resident)}
    mask = torch.tensor([[stack.owner[c].item() == order.get(name, -1) for c in range(columns)]
                         for name in row_adapter], dtype=torch.float32)
    b = torch.cat([w["p"].b for w in resident.values()], dim=1).float()
    want = y.float() + (h.float() * mask) @ b.T
    assert got.is_contiguous() and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, **({} if dtype == torch.float32 else dict(atol=0.1, rtol=0.01)))
    assert torch.equal(got[0], y[0]) and torch.equal(got[6], y[6])   # base rows untouched
