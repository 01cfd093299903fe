"""Progress: a tqdm bar on a terminal or in Jupyter (a widget), log lines otherwise (cron): rows, output tokens and
tok/s, the time left and predicted finish from the work left (job/eta.py), and whether the job is on track for its
deadline."""
from __future__ import annotations

import logging
import sys
import time
from datetime import datetime

from tqdm.auto import tqdm

from batchrun.job.eta import Eta, EtaEstimator
from batchrun.job.eta_text import clock_text, deadline_verdict, duration_text
from batchrun.job.run_summary import Estimate

log = logging.getLogger("batchrun.job")


def in_notebook() -> bool:
    """Inside a Jupyter (IPython) kernel, where stderr is not a terminal but a widget bar shows."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


class Progress:
    def __init__(self, total: int, done: int, tty: bool, log_every_s: float, name: str,
                 eta: EtaEstimator | None = None, deadline: datetime | None = None, job_path: str = "job.yaml"):
        self.total, self.done, self.failed, self.tokens = total, done, 0, 0
        self.start = self.last_log = time.monotonic()
        self.done_at_start, self.log_every_s = done, log_every_s
        self.estimator, self.deadline, self.job_path = eta, deadline, job_path
        self.eta: Eta | None = None
        self.bar = tqdm(total=total, initial=done, desc=name, unit="row", dynamic_ncols=True) if tty else None

    def row(self, failed: bool, tokens: int, max_tokens: int | None = None, prompt_tokens: int = 0) -> None:
        self.done += 1
        self.failed += failed
        self.tokens += tokens
        if self.estimator is not None and not failed and max_tokens:
            self.estimator.observe_finished(tokens, max_tokens, prompt_tokens)
        if self.bar is not None:
            self.bar.update(1)

    def tick(self, engine, queued) -> bool:
        """After each engine step; queued: rows read but not admitted. True when a report is due (every
        log_every_s): the caller then refreshes summary.json and metrics.prom."""
        now = time.monotonic()
        s = engine.stats
        if self.estimator is not None:   # it observes the engine's steps itself (EtaEstimator.from_engine)
            self.eta = self.estimator.estimate(engine.scheduler, queued)
        rate = self.tokens / max(now - self.start, 1e-9)
        detail = (f"{self.tokens} out tok, {rate:.1f} out tok/s, run {s.running}, wait {s.waiting}, "
                  f"kv {s.kv_blocks_used}/{engine.num_blocks}")
        if self.bar is not None:
            self.bar.set_postfix_str(f"{detail}, failed {self.failed}, {self.time_left()}", refresh=False)
        if now - self.last_log < self.log_every_s:
            return False
        self.last_log = now
        if self.bar is None:
            verdict = self.verdict()
            log.info("rows %d/%d (%d failed this run), %s, preemptions %d, %s%s", self.done, self.total, self.failed,
                     detail, s.preemptions, self.time_left(), f"; {verdict[1]}" if verdict else "")
        return True

    def time_left(self) -> str:
        if self.eta is None:
            return "time left ? (fitting the step time)"
        eta, finish = self.eta, datetime.fromtimestamp(self.eta.finish_at)
        spread = f"{duration_text(eta.low)}-{duration_text(eta.high)}, " if eta.low is not None else ""
        return f"time left ~{duration_text(eta.seconds_left)} ({spread}finish {clock_text(finish, datetime.now())})"

    def verdict(self) -> tuple[str, str] | None:
        if self.eta is None or self.deadline is None:
            return None
        return deadline_verdict(self.eta, self.deadline, self.job_path)

    def estimate(self) -> Estimate:
        """The estimate for summary.json and metrics.prom."""
        verdict, eta = self.verdict(), self.eta
        return Estimate.of(eta, self.deadline, None if verdict is None else verdict[0])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
