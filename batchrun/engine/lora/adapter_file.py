"""A PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`): its settings, its tensors'
shapes from the safetensors header, its fingerprint. Only safetensors are read (never a pickled .bin)."""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass

import torch

from batchrun.engine.loader import SafetensorsReader

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
_KEY = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")
# Settings whose non-default values change the math in ways this runner does not implement.
_UNSUPPORTED = {"use_dora": (False, None), "fan_in_fan_out": (False, None), "lora_bias": (False, None),
                "bias": ("none", None), "modules_to_save": (None, []), "use_qalora": (False, None),
                "trainable_token_indices": (None, {}), "target_parameters": (None, []),
                "alora_invocation_tokens": (None,)}


@dataclass(frozen=True)
class ModuleShape:
    """One adapted module as the file has it: rank, in features (A's columns), out features (B's rows), scale."""
    rank: int
    in_features: int
    out_features: int
    scaling: float


class AdapterFile:
    """The adapter at `path`, checked as a PEFT LoRA file (not yet against a model); tensors read on `load()`."""

    def __init__(self, name: str, path: str):
        self.name, self.path = name, path
        self.config_file, self.weights_file = os.path.join(path, CONFIG), os.path.join(path, WEIGHTS)
        for file in (self.config_file, self.weights_file):
            if not os.path.isfile(file):
                raise ValueError(f"adapter {name!r}: {file} does not exist (a PEFT LoRA adapter directory holds "
                                 f"{CONFIG} and {WEIGHTS})")
        self.config = self._read_config()
        with open(self.weights_file, "rb") as f:
            try:
                entries = SafetensorsReader(f).entries
            except (ValueError, OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"adapter {name!r}: {self.weights_file} is not a safetensors file ({exc})") from exc
        self.modules = self._module_shapes(entries)
        self.fingerprint = _sha256(self.config_file, self.weights_file)

    def nbytes(self, element_size: int, fused_rows: dict[str, int] | None = None) -> int:
        """The adapter's A and B matrices at `element_size` bytes per value; `fused_rows`: module leaf name (q_proj)
        -> the rows of the fused projection it is part of, where B is held block-diagonally over all of them."""
        rows = fused_rows or {}
        return element_size * sum(m.rank * (m.in_features + rows.get(module.rpartition(".")[2], m.out_features))
                                  for module, m in self.modules.items())

    def error(self, message: str, file: str | None = None) -> ValueError:
        return ValueError(f"adapter {self.name!r}: {file or self.weights_file}: {message}")

    def _read_config(self) -> dict:
        try:
            with open(self.config_file) as f:
                config = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise self.error(f"not valid JSON ({exc})", self.config_file) from exc
        if not isinstance(config, dict):
            raise self.error("must be a JSON object", self.config_file)
        if config.get("peft_type", "LORA") != "LORA":
            raise self.error(f"peft_type {config['peft_type']!r} is not supported (only LORA)", self.config_file)
        for key, fine in _UNSUPPORTED.items():
            if config.get(key, fine[0]) not in fine:
                raise self.error(f"{key}: {config[key]!r} is not supported (only {fine[0]!r})", self.config_file)
        for key in ("r", "lora_alpha"):
            value = config.get(key, 8)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise self.error(f"{key}: must be a positive number, got {value!r}", self.config_file)
        return config

    def _alpha(self, module: str) -> float:
        """lora_alpha, or the first alpha_pattern entry whose pattern ends the module's name (PEFT's matching)."""
        for pattern, alpha in (self.config.get("alpha_pattern") or {}).items():
            if re.fullmatch(rf"(.*\.)?(?:{pattern})", module):
                return float(alpha)
        return float(self.config.get("lora_alpha", 8))

    def _module_shapes(self, entries: dict) -> dict[str, ModuleShape]:
        pairs: dict[str, dict[str, list[int]]] = {}
        for key, entry in entries.items():
            m = _KEY.fullmatch(key)
            if m is None:
                raise self.error(f"tensor {key!r} is not a LoRA A or B weight (DoRA, biases, embeddings and "
                                 f"modules_to_save are not supported)")
            module, which = m.groups()
            if module.rsplit(".", 1)[-1] not in TARGETS:
                raise self.error(f"module {module!r} is not a supported target (supported: {', '.join(TARGETS)})")
            if len(entry["shape"]) != 2 or entry["dtype"] not in SafetensorsReader.DTYPES:
                raise self.error(f"module {module!r}: lora_{which} has shape {entry['shape']} and dtype "
                                 f"{entry['dtype']}; expected a 2-D floating-point matrix")
            pairs.setdefault(module, {})[which] = entry["shape"]
        if not pairs:
            raise self.error("holds no LoRA weights")
        shapes = {}
        for module, pair in sorted(pairs.items()):
            missing = {"A", "B"} - set(pair)
            if missing:
                raise self.error(f"module {module!r} has no lora_{missing.pop()} weight")
            (rank, fan_in), (fan_out, rank_b) = pair["A"], pair["B"]
            if rank != rank_b or rank == 0:
                raise self.error(f"module {module!r}: lora_A is {pair['A']} and lora_B is {pair['B']}; their "
                                 f"ranks must agree and be positive")
            root = math.sqrt(rank) if self.config.get("use_rslora", False) else rank
            shapes[module] = ModuleShape(rank, fan_in, fan_out, self._alpha(module) / root)
        return shapes

    def load(self, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Every module's (A [rank, in], B [out, rank])."""
        with open(self.weights_file, "rb") as f:
            reader = SafetensorsReader(f)
            return {m: tuple(reader.read(f"base_model.model.{m}.lora_{w}.weight").to(dtype) for w in "AB")
                    for m in self.modules}


def _sha256(*files: str) -> str:
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()
