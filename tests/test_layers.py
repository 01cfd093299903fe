"""The package's floors: each part imports only parts on floors below it (or its own), so the import graph has no
circle and no arrow that runs back up. A new module names its floor here."""
import ast
import fnmatch
import os

import batchrun

FLOORS = [
    {"cpuinfo", "cpu_timing", "paths", "config", "structured", "attention_metadata", "admission_order", "deadline"},
    {"sampling_params", "kernels"},
    {"models"},                              # model families; their CPU products call the kernels
    {"quant"},                               # quantized weights: formats, kernels, the loader's hook
    {"engine"},
    {"stepmodel", "kvcheck"},                # below the job (its ETA, its KV gate) and the planner
    {"job"},
    {"planner", "server"},
    {"cli_types", "cli_options"},            # the command line's checked number flags, its shared options
    {"cli_plan"},                            # `batchrun plan`, added to the main command by cli
    {"gpucheck", "cli"},
]
ROOT = os.path.dirname(batchrun.__file__)


def _part(module: str) -> str:
    """batchrun.engine.llm -> engine; `from batchrun import LLM` -> the part the public name comes from."""
    parts = module.split(".")
    if len(parts) == 2 and parts[1] in batchrun._PUBLIC:
        return _part(batchrun._PUBLIC[parts[1]])
    return parts[1] if len(parts) > 1 else "batchrun"


def _imports(path: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "batchrun":
            found |= {f"batchrun.{a.name}" for a in node.names} if node.module == "batchrun" else {node.module}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "batchrun"}
    return found


def test_every_import_runs_down_the_floors():
    floor = {part: i for i, parts in enumerate(FLOORS) for part in parts}
    upward, unplaced = [], set()
    for directory, _, files in os.walk(ROOT):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            here = _part("batchrun." + os.path.relpath(path, ROOT)[:-3].replace(os.sep, "."))
            if here in ("batchrun", "__init__"):
                continue   # the package's own __init__ only names the public objects, imported on first use
            for target in map(_part, _imports(path)):
                if here not in floor or target not in floor:
                    unplaced |= {p for p in (here, target) if p not in floor}
                elif target != here and floor[target] >= floor[here]:
                    upward.append(f"{os.path.relpath(path, ROOT)} ({here}, floor {floor[here]}) imports {target} "
                                  f"(floor {floor[target]})")
    assert not unplaced, f"parts with no floor in FLOORS: {sorted(unplaced)}"
    assert not upward, "\n".join(upward)


def test_every_subpackage_is_packaged():
    """A subpackage missing from pyproject's list works in the editable install of a checkout and is absent from a
    wheel (batchrun.stepmodel was, with its gpus.yaml)."""
    import tomllib
    config = tomllib.load(open(os.path.join(ROOT, "..", "pyproject.toml"), "rb"))["tool"]["setuptools"]
    found = {"batchrun." + os.path.relpath(d, ROOT).replace(os.sep, ".") for d, _, files in os.walk(ROOT)
             if any(f.endswith(".py") for f in files) and d != ROOT} | {"batchrun"}   # engine/ has no __init__
    assert set(config["packages"]) == found
    data = {name for patterns in config.get("package-data", {}).values() for name in patterns}
    shipped = {name for d, _, files in os.walk(ROOT) for name in files if name.endswith((".yaml", ".json", ".cpp"))}
    assert all(any(fnmatch.fnmatch(name, pattern) for pattern in data) for name in shipped), shipped
