"""Progress of a Ray run in rows and output tokens (Ray's own bars count blocks), across replicas: a bar on a
terminal, log lines otherwise, and the per-replica figures for summary.json.

The time left is the rows left at this run's row rate: the replicas' engines are out of reach of the local
executor's step-time simulation.
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict
from datetime import datetime

from tqdm.auto import tqdm

from batchrun.job.eta_text import clock_text, duration_text
from batchrun.job.run_summary import RunSummary

log = logging.getLogger("batchrun.job")
# the replica's engine figures, as its latest batch reported them
_LATEST = ("ready_at", "preemptions", "kv_cache_dtype", "kv_blocks_peak", "kv_blocks_total", "kv_pool_bytes",
           "peak_rss_bytes", "load_s")


class RayProgress:
    def __init__(self, total: int, done: int, tty: bool, log_every_s: float, name: str):
        self.total, self.done, self.rows, self.failed, self.tokens = total, done, 0, 0, 0
        self.start = self.last_log = time.monotonic()
        self.first_row_s: float | None = None
        self.log_every_s = log_every_s
        self.replicas: dict[str, dict] = defaultdict(lambda: {"rows": 0, "failed": 0, "output_tokens": 0})
        self.bar = tqdm(total=total, initial=done, desc=name, unit="row", dynamic_ncols=True) if tty else None

    def update(self, batches: list[dict]) -> bool:
        """Add the figures of finished batches; True when a report is due (every log_every_s)."""
        for b in batches:
            if self.first_row_s is None:
                self.first_row_s = time.monotonic() - self.start
            self.rows += b["rows"]
            self.failed += b["failed"]
            self.tokens += b["output_tokens"]
            replica = self.replicas[b["replica"]]
            for key in ("rows", "failed", "output_tokens"):
                replica[key] += b[key]
            replica.update({k: b[k] for k in _LATEST})
            replica["last_batch_at"] = b["finished_at"]
        self.done += sum(b["rows"] for b in batches)
        now = time.monotonic()
        line = (f"{self.tokens} out tok, {self.tokens / max(now - self.start, 1e-9):.1f} out tok/s, "
                f"{len(self.replicas)} replicas, failed {self.failed}, {self.time_left()}")
        if self.bar is not None:
            self.bar.update(sum(b["rows"] for b in batches))
            self.bar.set_postfix_str(line, refresh=False)
        if now - self.last_log < self.log_every_s:
            return False
        self.last_log = now
        if self.bar is None:
            log.info("rows %d/%d, %s", self.done, self.total, line)
        return True

    def time_left(self) -> str:
        elapsed = time.monotonic() - self.start
        if not self.rows:
            return "time left ?"
        left = (self.total - self.done) * elapsed / self.rows
        finish = datetime.fromtimestamp(time.time() + left)
        return f"time left {duration_text(left)} (finish {clock_text(finish, datetime.now())})"

    def summary(self) -> RunSummary:
        """This run's figures: totals and one entry per replica (a restarted actor is a new replica)."""
        wall = time.monotonic() - self.start
        replicas = []
        for name, r in sorted(self.replicas.items()):
            busy = max(r["last_batch_at"] - r["ready_at"], 1e-9)   # from the model loaded to the last batch
            replicas.append({"replica": name, **r, "output_tokens_per_s": round(r["output_tokens"] / busy, 2)})
        return RunSummary(rows_this_run=self.rows, wall_s=round(wall, 3), output_tokens_this_run=self.tokens,
                          output_tokens_per_s=round(self.tokens / max(wall, 1e-9), 2),
                          preemptions=sum(r.get("preemptions", 0) for r in replicas),
                          kv_blocks_peak=max((r["kv_blocks_peak"] for r in replicas), default=0), details={
                              "executor": "ray", "replicas": replicas, "time_to_first_row_s":
                              None if self.first_row_s is None else round(self.first_row_s, 3)})

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
