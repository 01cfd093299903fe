"""The GPU catalog: shipped data (gpus.yaml) merged with an optional user file, and --price overrides."""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass

import yaml

SHIPPED = os.path.join(os.path.dirname(__file__), "gpus.yaml")
FIELDS = {"memory_gb": True, "bandwidth_gbs": True, "fp16_tflops": True, "fp8_tflops": False,
          "price_per_hour": True, "source": True, "interconnect_gbs": False}   # field -> required
PCIE_GBS = 25.0   # what a GPU without a listed interconnect gets per direction in an all-reduce (PCIe 4.0 x16)


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gb: float
    bandwidth_gbs: float
    fp16_tflops: float
    fp8_tflops: float | None
    price_per_hour: float
    source: str
    interconnect_gbs: float | None = None   # GPU-to-GPU bandwidth per direction (NVLink); None: PCIe

    @property
    def allreduce_gbs(self) -> float:
        return self.interconnect_gbs or PCIE_GBS

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 1e9)


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as exc:
        raise ValueError(f"--catalog: cannot read {path} ({exc.strerror})") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"--catalog: {path} is not valid YAML ({exc})") from exc
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError(f"--catalog: {path} must map GPU names to mappings of {', '.join(FIELDS)}")
    return data


def _gpu(name: str, entry: dict, path: str) -> GPU:
    for key in entry:
        if key not in FIELDS:
            raise ValueError(f"{path}: {name}.{key}: unknown field; allowed: {', '.join(FIELDS)}")
    for key, required in FIELDS.items():
        value = entry.get(key)
        if value is None:
            if required:
                raise ValueError(f"{path}: {name}.{key}: required")
            continue
        if key != "source" and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise ValueError(f"{path}: {name}.{key}: must be a positive number, got {value!r}")
    return GPU(name=name, **{k: entry.get(k) for k in FIELDS})


def load_catalog(user_file: str | None = None) -> dict[str, GPU]:
    """Shipped entries, then the user's (a whole new entry, or some fields of a shipped one)."""
    raw = {name: dict(entry) for name, entry in _read(SHIPPED).items()}
    if user_file:
        for name, entry in _read(user_file).items():
            raw[str(name)] = {**raw.get(str(name), {}), **entry}
    return {name: _gpu(name, entry, user_file if user_file else SHIPPED) for name, entry in raw.items()}


def lookup(catalog: dict[str, GPU], name: str, field: str = "--gpu") -> GPU:
    """Case-insensitive lookup; an unknown name is an error with a did-you-mean."""
    by_lower = {k.lower(): k for k in catalog}
    key = by_lower.get(name.lower())
    prefixed = [k for low, k in by_lower.items() if low.startswith(name.lower())]
    if key is None and len(prefixed) == 1:
        key = prefixed[0]   # "H100" -> "H100-80GB"; "A100" stays ambiguous
    if key is None:
        close = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.5)
        hint = f"; did you mean {by_lower[close[0]]!r}?" if close else ""
        raise ValueError(f"{field}: unknown GPU {name!r}{hint} (known: {', '.join(catalog)}; "
                         f"add others with --catalog FILE)")
    return catalog[key]


def select(catalog: dict[str, GPU], names: list[str] | None = None,
           prices: dict[str, float] | None = None) -> list[GPU]:
    """The GPUs to plan for (all by default), with --price overrides applied."""
    chosen = [lookup(catalog, n) for n in names] if names else list(catalog.values())
    overrides = {lookup(catalog, n, "--price").name: p for n, p in (prices or {}).items()}
    out = []
    for gpu in chosen:
        if gpu.name in overrides:
            gpu = GPU(**{**gpu.__dict__, "price_per_hour": overrides[gpu.name],
                         "source": gpu.source + "; price from --price"})
        out.append(gpu)
    return out


def parse_prices(items) -> dict[str, float]:
    """--price NAME=USD (repeatable) -> {name: usd}."""
    prices = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            price = float(value)
        except ValueError:
            price = -1.0
        if not sep or not name.strip() or not 0 < price < float("inf"):   # NaN fails too
            raise ValueError(f"--price: expected NAME=USD_PER_HOUR with a positive price, got {item!r}")
        prices[name.strip()] = price
    return prices
