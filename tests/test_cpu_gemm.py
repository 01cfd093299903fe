"""Packed oneDNN linear layers match nn.Linear; where packing fails the layer runs unpacked, warning once; oneDNN's
caches of per-shape primitives stay bounded."""
import logging
import os
import subprocess
import sys

import pytest

import torch
import torch.nn.functional as F

from batchrun.models import cpu_gemm
from batchrun.models.layers import Linear


def test_packed_linear_matches_unpacked():
    torch.manual_seed(0)
    layer = Linear(48, 80, bias=True)
    weight = layer.weight.detach().clone()
    assert layer.pack_for_cpu() == torch.backends.mkldnn.is_available()   # float32 packs wherever oneDNN is built
    if layer.packed is not None:
        assert layer.weight.numel() == 0 and layer.weight.dtype == weight.dtype   # the packed copy is the only one
    for shape in ((1, 48), (7, 48), (33, 48), (2, 5, 48)):
        x = torch.randn(shape)
        torch.testing.assert_close(layer(x), F.linear(x, weight, layer.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_one_copy_of_each_weight_and_the_tied_embedding_kept(tmp_path):
    """After LLM(...) every projection's dense weight is gone (packed only); a tied lm_head keeps the weight it
    shares with the embedding, whose lookups need it."""
    from batchrun import LLM
    from conftest import save_tiny_model
    save_tiny_model(tmp_path, tie_word_embeddings=True)
    model = LLM(model=str(tmp_path), kv_cache_memory="4MiB").engine.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.packed is not None for m in linears)
    assert all(m.weight.numel() == 0 for m in linears if m is not model.lm_head)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.lm_head.weight.numel() > 0


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


GROWTH = """
import ctypes, os, torch
from batchrun.models import cpu_gemm
packed, x = cpu_gemm.pack(torch.randn(64, 32)), torch.randn(600, 32)
def resident():
    ctypes.CDLL(None).malloc_trim(0)   # count what is in use, not freed pages glibc still holds
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
for rows in range(1, 301):   # more row counts than the caches keep: they are full
    cpu_gemm.linear(x[:rows], packed, None)
before = resident()
for rows in range(301, 601):
    cpu_gemm.linear(x[:rows], packed, None)
print(resident() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or not torch.backends.mkldnn.is_available(),
                    reason="reads /proc and calls glibc's malloc_trim; needs oneDNN")
def test_per_shape_primitive_caches_stay_bounded():
    """Each new row count is a new oneDNN primitive (about 560 KiB in oneDNN's and ideep's caches together): once the
    caches are full, 300 more row counts must not grow the process (with the default 1,024 entries: about 160 MiB)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", GROWTH], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) < 30 * 2**20
