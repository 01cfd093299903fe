"""Every C++ kernel builds wherever a C++ compiler is found, on any CPU. A failed build falls back to a slower path
with a warning, and the kernel tests skip: without this test a kernel that builds only with AMX (a discarded
`if constexpr` branch still looks up the AMX names) slowed every other CPU and failed nothing."""
import os
import shutil

import pytest

from batchrun.kernels import amx_linear, cpu_attention, lora_expand, rotate_quant

KERNELS = {"cpu_attention": cpu_attention._kernel, "rotate_quant": rotate_quant._kernel,
           "lora_expand": lora_expand._kernel, "amx_linear": amx_linear._kernel}


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler here")
@pytest.mark.skipif(os.environ.get("BATCHRUN_CPU_KERNELS", "1") == "0", reason="kernels turned off")
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_builds_on_this_cpu(name):
    assert KERNELS[name].load() is not None, f"{name} failed to build here: see the log's build error"
