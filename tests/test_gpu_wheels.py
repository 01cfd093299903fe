"""The wheels that travel to the lent GPU machine (scripts/gpu/wheels.txt, downloaded by scripts/gpu_wheels.sh):
together with the machine's own packages they cover every import of batchrun and of the tests run there, their
own requirements are met, and the downloaded folder fits the transfer. No network: imports are read with ast."""
import ast
import importlib.metadata
import re
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "scripts" / "gpu"
WHEELS_DIR = ROOT / ".gpu_wheels"
LIMIT_BYTES = 60 * 2**20        # of the 64 MiB a device call carries, the tree itself takes about 1 MiB
# the lent machine: Python 3.12 on x86-64 Linux
MARKER_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "os_name": "posix",
              "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
              "platform_python_implementation": "CPython", "extra": ""}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def entries(file: str) -> list[tuple[str, str]]:
    """(first word, comment) of each line that is not blank or a comment."""
    rows = []
    for line in (GPU / file).read_text().splitlines():
        text, _, comment = line.partition("#")
        if text.strip():
            rows.append((text.split()[0], comment.strip()))
    return rows


DEVICE = {norm(n) for n, _ in entries("device_packages.txt")}
PINNED = {norm(spec.split("==")[0]): spec.split("==")[1] for spec, _ in entries("wheels.txt")}
OVERRIDES = {norm(spec.split("==")[0]) for spec, why in entries("wheels.txt") if why.startswith("override:")}
NOT_CARRIED = {norm(n): why for n, why in entries("not_carried.txt") if not n.startswith("batchrun.")}
NOT_RUN = {n: why for n, why in entries("not_carried.txt") if n.startswith("batchrun.")}


def imports(path: Path) -> list[tuple[str, bool, int]]:
    """(dotted module, imported at module level, line) of each absolute import in the file; `from a import b`
    gives a and a.b (b may be a module)."""
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((a.name, not in_function, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0:
                found.append((child.module, not in_function, child.lineno))
                found.extend((f"{child.module}.{a.name}", not in_function, child.lineno) for a in child.names)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
    visit(ast.parse(path.read_text()), False)
    return found


def not_run(module: str) -> bool:
    return any(module == p or module.startswith(p if p.endswith("_") else p + ".") for p in NOT_RUN)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def check_files() -> list[Path]:
    """Every batchrun module, and the test files run on the machine with the test modules they import."""
    files = sorted((ROOT / "batchrun").rglob("*.py"))
    tests = [ROOT / t for t, _ in entries("tests.txt")] + [ROOT / "tests" / "conftest.py"]
    while tests:
        path = tests.pop()
        if path not in files:
            files.append(path)
            # a test module imported inside a function (a fixture the machine's tests do not use) is not followed
            tests += [ROOT / "tests" / f"{m}.py" for m, module_level, _ in imports(path)
                      if module_level and (ROOT / "tests" / f"{m}.py").exists()]
    return files


def test_lists_are_well_formed():
    assert PINNED and all(re.fullmatch(r"[0-9][0-9a-z.]*", v) for v in PINNED.values())
    assert len(PINNED) == len(entries("wheels.txt")), "a name pinned twice: the install would stop"
    assert set(PINNED) & DEVICE == OVERRIDES, "carried although the machine has it, and not marked override:"
    assert all(NOT_CARRIED.values()), "every name in not_carried.txt says why the check never imports it"
    assert all((ROOT / t).exists() for t, _ in entries("tests.txt"))
    assert ".gpu_wheels/" in (ROOT / ".gitignore").read_text().split()


def test_every_import_of_the_check_is_on_the_device_or_carried():
    dist_of = importlib.metadata.packages_distributions()
    local = {p.stem for p in (ROOT / "tests").glob("*.py")}
    problems = []
    for path in check_files():
        in_package = path.is_relative_to(ROOT / "batchrun")
        skipped = in_package and not_run(module_name(path))
        for dotted, module_level, line in imports(path):
            top = dotted.split(".")[0]
            where = f"{path.relative_to(ROOT)}:{line} imports {dotted if top == 'batchrun' else top}"
            if top == "batchrun":
                if module_level and not skipped and not_run(dotted):
                    problems.append(f"{where} at its top, which scripts/gpu/not_carried.txt says the check never "
                                    f"imports: import it inside the function that needs it")
                continue
            if top in sys.stdlib_module_names or top in local or top == "__future__":
                continue
            dists = {norm(d) for d in dist_of.get(top, [])}
            if not dists:
                problems.append(f"{where}, which is not installed here: cannot tell its distribution")
            for dist in dists - DEVICE - set(PINNED):
                if dist not in NOT_CARRIED:
                    problems.append(f"{where} ({dist}): neither on the machine nor in scripts/gpu/wheels.txt")
                elif not skipped and (module_level or not in_package):
                    problems.append(f"{where} ({dist}) in a module the check imports: not_carried.txt covers "
                                    f"the modules it lists and imports inside batchrun's functions only")
    assert not problems, ("add the distribution to scripts/gpu/wheels.txt (then run scripts/gpu_wheels.sh), or, "
                          "where the check never runs that import, to scripts/gpu/not_carried.txt:\n"
                          + "\n".join(sorted(set(problems))))


def _metadata(name: str, version: str) -> tuple[list[str], str]:
    """(Requires-Dist lines, where they were read): the downloaded wheel when there, else what is installed here."""
    for wheel in WHEELS_DIR.glob("*.whl"):
        wheel_name, wheel_version, _, _ = parse_wheel_filename(wheel.name)
        if norm(wheel_name) == name and str(wheel_version) == version:
            with zipfile.ZipFile(wheel) as z:
                meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
                return Parser().parsestr(z.read(meta).decode()).get_all("Requires-Dist") or [], wheel.name
    dist = importlib.metadata.distribution(name)
    return dist.requires or [], f"{name} {dist.version} installed here"


def test_carried_wheels_requirements_are_on_the_device_or_carried():
    unmet = []
    for name, version in PINNED.items():
        requires, source = _metadata(name, version)
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(MARKER_ENV):
                if norm(req.name) not in DEVICE and norm(req.name) not in PINNED:
                    unmet.append(f"{name} needs {req} ({source})")
    assert not unmet, "add these to scripts/gpu/wheels.txt:\n" + "\n".join(unmet)


@pytest.mark.skipif(not WHEELS_DIR.exists(), reason="no .gpu_wheels/ here: run scripts/gpu_wheels.sh")
def test_downloaded_wheels_are_the_pinned_set_and_fit_the_transfer():
    wheels = sorted(WHEELS_DIR.glob("*.whl"))
    got = {}
    for wheel in wheels:
        name, version, _, tags = parse_wheel_filename(wheel.name)
        got[norm(name)] = str(version)
        assert any(t.interpreter in ("py3", "cp312") and t.platform in ("any", "linux_x86_64") or
                   t.platform.startswith("manylinux") and t.platform.endswith("x86_64") for t in tags), wheel.name
    assert got == PINNED and len(wheels) == len(PINNED)
    size = sum(w.stat().st_size for w in wheels)
    assert size < LIMIT_BYTES, f".gpu_wheels/ holds {size / 2**20:.1f} MiB, over {LIMIT_BYTES / 2**20:.0f} MiB"


def test_gpu_scripts_parse():
    for script in ("gpu_wheels.sh", "gpu_check.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], check=True)
