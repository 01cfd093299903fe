"""Every C++ kernel builds wherever a C++ compiler is found, on any CPU. A failed build falls back to a slower path
with a warning, and the kernel tests skip: without this test a kernel that builds only with AMX (a discarded
`if constexpr` branch still looks up the AMX names) slowed every other CPU and failed nothing."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from batchrun.kernels import amx_linear, cpu_attention, lora_expand, native_linear

KERNELS = {"cpu_attention": cpu_attention._kernel, "native_linear": native_linear._kernel,
           "lora_expand": lora_expand._kernel, "amx_linear": amx_linear._kernel}
COMPILER = os.environ.get("CXX", "c++")   # as torch's cpp_extension picks it
needs_compiler = pytest.mark.skipif(shutil.which(COMPILER) is None, reason="no C++ compiler here")


@needs_compiler
@pytest.mark.skipif(os.environ.get("BATCHRUN_CPU_KERNELS", "1") == "0", reason="kernels turned off")
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_builds_on_this_cpu(name):
    assert KERNELS[name].load() is not None, f"{name} failed to build here: see the log's build error"


# Other CPUs' builds (compiled, not run): the three code paths the kernels choose between at compile time.
TARGETS = {"avx2": ("haswell", "AVX2"), "avx512": ("skylake-avx512", "AVX512"), "amx": ("sapphirerapids", "AVX512")}


@needs_compiler
@pytest.mark.parametrize("source, targets", [("cpu_attention.cpp", ("avx2", "avx512", "amx")),
                                             ("native_linear.cpp", ("avx2", "avx512"))])   # no AMX code in it
def test_kernel_compiles_for_other_cpus(source, targets):
    """The kernels with AVX-512 code paths, for each of their targets: an AVX2 CPU, an AVX-512 one without BF16 and,
    for the one with AMX code, an AMX CPU (g++ -fsyntax-only with each -march and the CPU_CAPABILITY macro
    cpp_build.py would pass), whatever this machine is."""
    import sysconfig

    from torch.utils import cpp_extension
    source = Path(cpu_attention.__file__).with_name(source)
    includes = [f"-I{path}" for path in [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]]
    runs = {name: subprocess.Popen(
        [COMPILER, "-fsyntax-only", "-std=c++20", f"-march={march}", "-fopenmp",
         f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}", "-DTORCH_EXTENSION_NAME=check",
         *includes, str(source)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for name, (march, capability) in TARGETS.items() if name in targets}
    failed = {name: run.communicate()[0][-2000:] for name, run in runs.items() if run.wait() != 0}
    assert not failed, failed
