"""The record kept of a workload timed several times (bench/vs_vllm.py, and vllm_worker.py inside vLLM's venv: no
batchrun import here): the fastest call's figures, and every call's wall time."""


def keep_fastest(kept: dict | None, call: dict) -> dict:
    """The faster of the record kept so far (None before the first call) and this call (its wall_s and figures),
    with wall_s_each: every call's wall_s in order."""
    best = call if kept is None or call["wall_s"] < kept["wall_s"] else kept
    return {**best, "wall_s_each": (kept["wall_s_each"] if kept else []) + [call["wall_s"]]}
