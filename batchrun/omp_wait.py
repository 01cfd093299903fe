"""How long an OpenMP thread spins at a barrier before it sleeps, set before torch loads its OpenMP runtime (libgomp
reads it once, when it is loaded).

The whole-model graph runs a few hundred parallel regions a step. While another process keeps one of the cores
busy, the thread that reaches a barrier first waits for the displaced one, and while it spins that thread cannot
move to the spinning thread's core. An SmolLM2 float32 decode step of 7 sequences on 2 threads (this Xeon; one
thread: 76.5 ms), median ms:

| libgomp setting             | quiet | a busy loop on the other core |
|-----------------------------|-------|-------------------------------|
| default (spin 300,000)      | 50.6  | 332.1                         |
| GOMP_SPINCOUNT=10000        | 51.0  | 193.8                         |
| GOMP_SPINCOUNT=1000         | 68.6  | 96.2                          |
| OMP_WAIT_POLICY=PASSIVE     | 82.5  | 87.5                          |

10,000 spins cost nothing on a quiet machine and take 42 % off the busy case; shorter spins or sleeping at once
cost 35-63 % when the machine is quiet. An OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment is kept."""
from __future__ import annotations

import os

SPIN_COUNT = "10000"


def set_default() -> None:
    """GOMP_SPINCOUNT unless a wait policy or spin count is set. Where torch is already imported (a notebook that
    imported it first) this process keeps the runtime's setting; the processes it starts inherit this one."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
