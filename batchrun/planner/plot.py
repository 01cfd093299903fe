"""`batchrun plan --plot`: decode throughput against concurrency per KV dtype with each dtype's memory limit, and
the job's predicted progress over time (matplotlib, an optional extra)."""
from __future__ import annotations

import numpy as np

from batchrun.stepmodel.simulate import timeline


def require_matplotlib() -> None:
    """Fail before any planning work when the optional extra is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot: needs matplotlib; install it with: pip install 'batchrun[plot]'") from None


def _plotted_gpu(report: dict) -> str | None:
    """The recommended GPU type, else the first one that fits."""
    rec = report["recommendation"]
    if rec:
        return rec["gpu"]
    return next((r["gpu"] for r in report["rows"] if r.get("fits")), None)


def draw(planner, report: dict, gpus: list, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    name = _plotted_gpu(report)
    rows = [r for r in report["rows"] if r["gpu"] == name and r.get("fits")]
    gpu = next((g for g in gpus if g.name == name), None)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    if not rows:
        fig.suptitle("no GPU type fits this job: nothing to draw")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return
    context = int(report["job"]["mean_request"])
    seats = report["settings"]["max_num_seqs"]
    top = max(max(r["max_concurrency_mix"] for r in rows), seats) * 1.25
    batch = np.unique(np.geomspace(1, top, 80).astype(int))
    lines = {}
    for i, r in enumerate(rows):
        color = f"C{i}"
        cost = planner.cost_model(gpu, r["kv_bytes_per_token"])
        rate = [b / cost.decode_step(int(b), context) for b in batch]
        limit = r["max_concurrency_mix"]
        inside = batch <= limit
        left.plot(batch[inside], np.array(rate)[inside], color=color, label=f"{r['kv_dtype']} KV")
        left.plot(batch[~inside], np.array(rate)[~inside], color=color, linestyle=":")
        left.axvline(limit, color=color, linestyle="--", linewidth=1)
        left.annotate(f"{r['kv_dtype']} memory limit ({limit})", (limit, rate[0]), rotation=90, fontsize=8,
                      color=color, va="bottom", ha="right")
        shard = r.get("gpus") or 1
        lines[r["kv_dtype"], shard, color] = timeline(planner.trace(r["blocks"], shard), cost.step_time).progress()
    left.axvline(seats, color="grey", linestyle="-.", linewidth=1, label=f"max_num_seqs ({seats})")
    left.set(xscale="log", xlabel=f"concurrent requests (mean context {context} tokens)",
             ylabel="decode output tokens/s per GPU", title=f"{name}: throughput vs concurrency (roofline)")
    left.legend(fontsize=8)
    deadline = report["settings"]["deadline_s"]
    longest = max([deadline or 0] + [p[-1][0] for p in lines.values()])
    unit, div = ("hours", 3600) if longest >= 7200 else ("minutes", 60) if longest >= 120 else ("seconds", 1)
    for (dtype, shard, color), points in lines.items():
        seconds, done = zip(*points)
        right.plot(np.array(seconds) / div, done, color=color, label=f"{dtype} KV, {shard} GPU{'s' if shard > 1 else ''}")
    if deadline:
        right.axvline(deadline / div, color="black", linestyle="--", linewidth=1, label="deadline")
    right.set(xlabel=unit, ylabel="fraction of requests finished", ylim=(0, 1.02),
              title=f"{name}: predicted progress per replica (simulated scheduler)")
    right.legend(fontsize=8)
    fig.suptitle(f"{report['model']['name']}: {report['job']['requests']} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
