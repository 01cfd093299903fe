"""`dtype: auto` on a CPU: bfloat16 only with native bf16 flags and a faster measured product; forced by env."""
import pytest
import torch

from batchrun.engine import cpu_dtype


@pytest.fixture
def probe(monkeypatch):
    monkeypatch.delenv("BATCHRUN_CPU_DTYPE", raising=False)
    cpu_dtype.auto_cpu_dtype.cache_clear()
    yield monkeypatch
    cpu_dtype.auto_cpu_dtype.cache_clear()


def fake(monkeypatch, flags, bf16_s, fp32_s):
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: set(flags))
    monkeypatch.setattr(cpu_dtype, "_matmul_seconds", lambda dtype, **_: bf16_s if dtype == torch.bfloat16 else fp32_s)


def test_no_bf16_flags_means_float32(probe):
    fake(probe, {"avx2", "fma"}, bf16_s=0.001, fp32_s=1.0)   # even a fast-looking bf16 is not trusted without flags
    dtype, why = cpu_dtype.auto_cpu_dtype()
    assert dtype == torch.float32 and "no native bf16" in why


def test_native_bf16_and_faster_means_bfloat16(probe):
    fake(probe, {"avx512f", "avx512_bf16"}, bf16_s=0.002, fp32_s=0.006)
    dtype, why = cpu_dtype.auto_cpu_dtype()
    assert dtype == torch.bfloat16 and "avx512_bf16" in why


def test_flags_but_slower_bf16_means_float32(probe):
    fake(probe, {"amx_bf16"}, bf16_s=0.010, fp32_s=0.006)
    dtype, why = cpu_dtype.auto_cpu_dtype()
    assert dtype == torch.float32 and "slower" in why


def test_environment_forces_the_choice(probe):
    fake(probe, {"avx512_bf16"}, bf16_s=0.002, fp32_s=0.006)
    probe.setenv("BATCHRUN_CPU_DTYPE", "float32")
    assert cpu_dtype.auto_cpu_dtype()[0] == torch.float32
    cpu_dtype.auto_cpu_dtype.cache_clear()
    probe.setenv("BATCHRUN_CPU_DTYPE", "float16")
    with pytest.raises(ValueError, match="BATCHRUN_CPU_DTYPE"):
        cpu_dtype.auto_cpu_dtype()


def test_the_timed_product_runs_on_one_thread_and_gives_the_threads_back(monkeypatch):
    """Two threads on a busy machine wait for each other's time slices, which can make bf16 look slower than it is."""
    threads_seen, mm = [], torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: threads_seen.append(torch.get_num_threads()) or mm(a, b))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert cpu_dtype._matmul_seconds(torch.float32, size=16, reps=2) > 0
        assert threads_seen == [1, 1, 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
