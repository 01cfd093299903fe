"""Progress: a tqdm bar on a terminal (rows done/total, output tokens/s, ETA); log lines otherwise (cron)."""
from __future__ import annotations

import logging
import time

from tqdm.auto import tqdm

log = logging.getLogger("batchrun.job")


class Progress:
    def __init__(self, total: int, done: int, tty: bool, log_every_s: float, name: str):
        self.total, self.done, self.failed, self.tokens = total, done, 0, 0
        self.start = self.last_log = time.monotonic()
        self.done_at_start, self.log_every_s = done, log_every_s
        self.bar = tqdm(total=total, initial=done, desc=name, unit="row", dynamic_ncols=True) if tty else None

    def row(self, failed: bool, tokens: int) -> None:
        self.done += 1
        self.failed += failed
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(1)

    def tick(self, engine) -> None:
        now = time.monotonic()
        rate = self.tokens / max(now - self.start, 1e-9)
        s = engine.stats
        detail = f"{rate:.1f} out tok/s, run {s.running}, wait {s.waiting}, kv {s.kv_blocks_used}/{engine.num_blocks}"
        if self.bar is not None:
            self.bar.set_postfix_str(f"{detail}, failed {self.failed}", refresh=False)
        elif now - self.last_log >= self.log_every_s:
            self.last_log = now
            rows_rate = (self.done - self.done_at_start) / max(now - self.start, 1e-9)
            eta = f"{(self.total - self.done) / rows_rate:.0f}s" if rows_rate > 0 else "?"
            log.info("rows %d/%d (%d failed this run), %s, preemptions %d, ETA %s",
                     self.done, self.total, self.failed, detail, s.preemptions, eta)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
