"""Packed oneDNN linear layers match nn.Linear; where packing fails the layer runs unpacked, warning once."""
import logging

import torch
import torch.nn.functional as F

from batchrun.models import cpu_gemm
from batchrun.models.layers import Linear


def test_packed_linear_matches_unpacked():
    torch.manual_seed(0)
    layer = Linear(48, 80, bias=True)
    assert layer.pack_for_cpu() == torch.backends.mkldnn.is_available()   # float32 packs wherever oneDNN is built
    for rows in (1, 7, 33):
        x = torch.randn(rows, 48)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_failed_packing_warns_once_and_runs_unpacked(monkeypatch, caplog):
    def refuse(weight, hint):
        raise RuntimeError("no packing on this CPU")
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse, raising=False)
    monkeypatch.setattr(cpu_gemm, "_unpackable", set())
    layers = [Linear(16, 16, bias=False) for _ in range(3)]
    with caplog.at_level(logging.WARNING, logger="batchrun"):
        assert not any(layer.pack_for_cpu() for layer in layers)
    assert sum("packing unavailable" in r.message for r in caplog.records) == 1
    x = torch.randn(4, 16)
    torch.testing.assert_close(layers[0](x), F.linear(x, layers[0].weight))
