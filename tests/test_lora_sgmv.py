"""The LoRA SGMV kernels (shrink and expand over segments of rows sorted by adapter) against the per-segment torch
product; on CPU under TRITON_INTERPRET=1 (set in conftest.py). Segments of different ranks (up to 64 x 3 for a
fused q/k/v), lengths crossing the 16-row tiles, base rows between segments (left untouched), widths past one
64-wide tile."""
import pytest
import torch

pytest.importorskip("triton")

from batchrun.kernels import lora_sgmv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter (3.9) computes tl.dot on bfloat16 operands wrongly, so bfloat16 runs only on a GPU.
BF16 = pytest.param(torch.bfloat16, 2e-2, marks=pytest.mark.skipif(
    DEVICE == "cpu", reason="the Triton interpreter's tl.dot is wrong for bfloat16"))
IN, OUT = 80, 144
# adapter: (first column in the stack, rank)
COLUMNS = {"r8": (0, 8), "r24": (8, 24), "r192": (32, 192)}
# (first row, end row, adapter): rows 0-3 and 40-44 are base rows
SEGMENTS = [(3, 20, "r8"), (20, 21, "r24"), (21, 40, "r192"), (44, 61, "r8")]
ROWS = 64


def reference(x, a, b, y):
    out = y.float().clone()
    for start, end, name in SEGMENTS:
        col, rank = COLUMNS[name]
        out[start:end] += (x[start:end].float() @ a[col:col + rank].float().T) @ b[:, col:col + rank].float().T
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 5e-3), BF16])
def test_shrink_then_expand_matches_per_segment_products(dtype, tol):
    g = torch.Generator().manual_seed(0)
    width = sum(rank for _, rank in COLUMNS.values())
    x, a = torch.randn(ROWS, IN, generator=g), torch.randn(width, IN, generator=g) * 0.1
    b, y = torch.randn(OUT, width, generator=g) * 0.1, torch.randn(ROWS, OUT, generator=g)
    x, a, b, y = (t.to(dtype) for t in (x, a, b, y))
    ref = reference(x, a, b, y)
    table = lora_sgmv.tiles([(s, e, *COLUMNS[n]) for s, e, n in SEGMENTS], DEVICE)
    assert len(table) == 2 + 1 + 2 + 2   # 17 rows: two 16-row tiles; 1; 19: two; 17: two
    out = y.clone().to(DEVICE)
    h = lora_sgmv.shrink(x.to(DEVICE), a.to(DEVICE), table, max(rank for _, rank in COLUMNS.values()))
    lora_sgmv.expand(out, h, b.to(DEVICE), table)
    out = out.cpu()
    base_rows = [*range(0, 3), *range(40, 44), *range(61, ROWS)]
    assert torch.equal(out[base_rows], y[base_rows])
    err = ((out.float() - ref).norm() / (ref - y.float()).norm()).item()
    assert err < tol


def test_no_segments_leaves_the_output_alone():
    y = torch.randn(4, OUT, device=DEVICE)
    before = y.clone()
    table = lora_sgmv.tiles([], DEVICE)
    lora_sgmv.expand(y, lora_sgmv.shrink(torch.randn(4, IN, device=DEVICE), torch.randn(8, IN, device=DEVICE),
                                         table, 8), torch.randn(OUT, 8, device=DEVICE), table)
    assert torch.equal(y, before)


def test_mismatched_shapes_are_refused():
    table = lora_sgmv.tiles([(0, 2, 0, 4)], DEVICE)
    with pytest.raises(ValueError, match=r"lora sgmv: a \[4, 81\] does not fit the operand \[2, 80\]"):
        lora_sgmv.shrink(torch.randn(2, IN, device=DEVICE), torch.randn(4, IN + 1, device=DEVICE), table, 4)
    with pytest.raises(ValueError, match="lora sgmv: b is torch.float16, the operand torch.float32"):
        lora_sgmv.expand(torch.randn(2, OUT, device=DEVICE), torch.randn(2, 4, device=DEVICE),
                         torch.randn(OUT, 4, device=DEVICE, dtype=torch.float16), table)
