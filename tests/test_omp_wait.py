"""`import batchrun` sets libgomp's spin count before torch loads its runtime (batchrun/omp_wait.py), and keeps a
spin count or wait policy the user set."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHOW = "import batchrun, os; print(os.environ.get('GOMP_SPINCOUNT'))"


def spin_count_after_import(**env) -> str:
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", SHOW], env={**environ, "PYTHONPATH": ROOT, **env},
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_spin_count_by_default_and_the_users_settings_kept():
    assert spin_count_after_import() == "10000"
    assert spin_count_after_import(GOMP_SPINCOUNT="500") == "500"
    assert spin_count_after_import(OMP_WAIT_POLICY="PASSIVE") == "None"   # the policy decides the spin count


def test_set_before_torch_is_imported():
    # batchrun's package import loads no torch: the setting is in the environment when torch's libgomp reads it.
    out = subprocess.run([sys.executable, "-c", "import batchrun, sys; print('torch' in sys.modules)"],
                         env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
