"""The whole-model graph's linear products as C++ operators (native_linear.cpp): `batchrun_native::packed_linear`
for oneDNN-packed float weights and `batchrun_native::rotated_w8a8` for rotated W8A8 layers on oneDNN's int8
product. They find their weights by the layers' graph handles in a registry of their own, filled by `register`.
Where the module does not build, the layers keep graph.py's and quant/linear.py's Python ops."""
from __future__ import annotations

import weakref
from pathlib import Path

import torch

from batchrun.kernels import cpp_build

_kernel = cpp_build.Kernel("batchrun_native_linear",
                           [Path(__file__).with_name(name) for name in ("native_linear.cpp", "rotate_quant.h",
                                                                         "cpu_vec.h")],
                           "native linear ops", "the Python ops")
_fakes_registered = False


def load():
    """The compiled module, or None (see cpp_build.load); its operators' shape functions are registered once."""
    global _fakes_registered
    module = _kernel.load()
    if module is not None and not _fakes_registered:
        _fakes_registered = True
        torch.library.register_fake("batchrun_native::packed_linear")(
            lambda x, handle, out_features, bias: x.new_empty(x.shape[0], out_features))
        torch.library.register_fake("batchrun_native::rotated_w8a8")(
            lambda x, handle, out_features, block: x.new_empty(x.shape[0], out_features))
    return module


def register(owner: object, handle: int, packed: torch.Tensor, scale: torch.Tensor | None = None,
             zero_points: torch.Tensor | None = None) -> bool:
    """Make `packed` (a oneDNN-packed float weight, or an int8 one with its float32 scale and int64 zero points
    per output channel) what the operators find under `handle`, until `owner` is garbage-collected or `release`;
    False where the module does not build here."""
    module = load()
    if module is None:
        return False
    module.register_weight(handle, packed, scale, zero_points)
    weakref.finalize(owner, module.release, handle)
    return True


def release(handle: int) -> None:
    if _kernel.module is not None:
        _kernel.module.release(handle)
