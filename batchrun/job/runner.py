"""`batchrun submit`: check everything, take the lock, load the model, stream rows through the engine, save.

Rows are fed incrementally (at most max_num_seqs + max_waiting in the engine), so memory stays bounded
however large the input. SIGTERM/SIGINT stop admission, save finished rows and exit with EXIT_INTERRUPTED.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time

from batchrun.job import joblog, kv_gate, preflight, prepare, report
from batchrun.job.records import RecordMaker, extra_columns
from batchrun.job.bucketing import RowFeed
from batchrun.job.errors import EXIT_FAILED_ROWS, EXIT_INTERRUPTED, EXIT_OK
from batchrun.job.eta import EtaEstimator
from batchrun.job.progress import Progress, in_notebook
from batchrun.job.prompts import PromptEncoder
from batchrun.job.run_summary import Estimate, RunSummary
from batchrun.job.sink import ResultSink, job_lock, result_schema
from batchrun.job.source import Row
from batchrun.job.spec import JobSpec
from batchrun.job.storage import Storage
from batchrun.engine.parallel import TensorParallelError

log = logging.getLogger("batchrun.job")


class JobRunner:
    def __init__(self, spec: JobSpec, restart: bool = False, progress: str = "auto", serve=None,
                 force: bool = False):
        self.spec, self.restart = spec, restart
        self.force = force   # run on a store where batchrun cannot take the job's lock (sink.job_lock)
        self.serve = serve   # optional llm -> context manager serving HTTP on the job's engine (submit --serve)
        self.tty = (sys.stderr.isatty() or in_notebook()) if progress == "auto" else progress == "bar"
        self.stop_reason: str | None = None

    def run(self) -> tuple[str, dict]:
        """(output directory, summary). Raises JobError before any work for a bad spec, input or output."""
        spec = self.spec
        with self._signals():   # from the start: a SIGTERM during start-up or model load also exits 5
            return self._run(spec)

    def _run(self, spec: JobSpec) -> tuple[str, dict]:
        source = prepare.open_source(spec)
        out_dir = prepare.output_dir(spec)
        with job_lock(out_dir, spec.storage.lock_lease_s, self.force, self._lost) as lock:
            total = prepare.count_rows(spec, source)
            preflight.check_model(spec)   # before the output is claimed: a job that cannot start claims nothing
            prepare.claim_output(spec, out_dir, prepare.job_state(spec, source.files, total), self.restart)
            sink = ResultSink(out_dir, result_schema(source.id_type, source.passthrough_schema() + extra_columns(spec)),
                              spec.output.shard_rows, spec.output.flush_every_s)
            done = sink.store.done_indices()
            handlers = self._log_to(out_dir)
            try:
                if getattr(lock, "took_over", None):   # an object store's lock, taken from a crashed submit
                    log.warning(lock.took_over)
                log.info("job %s: %d rows, %d already done, output %s", self._name(), total, len(done), out_dir)
                run = self._generate(source, sink, done, total, out_dir) if len(done) < total else RunSummary()
                return out_dir.root, self._finish(out_dir, sink, run)
            finally:
                for handler in handlers:
                    log.removeHandler(handler)
                    handler.close()

    def _name(self) -> str:
        return self.spec.name or os.path.splitext(os.path.basename(self.spec.path))[0]

    def _lost(self, reason: str) -> None:
        """The lock's lease was taken over (object stores): stop as a signal does."""
        if self.stop_reason is None:
            self.stop_reason = reason

    def _log_to(self, out_dir: Storage) -> list[logging.Handler]:
        """job.log in the output directory always; stderr too when there is no progress bar."""
        handlers = [joblog.handler(out_dir)]
        if not self.tty:
            handlers.append(logging.StreamHandler(sys.stderr))
        for handler in handlers:
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
            log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
        return handlers

    def _generate(self, source, sink: ResultSink, done: set[int], total: int, out_dir: Storage) -> RunSummary:
        from batchrun import LLM
        spec = self.spec
        try:
            llm = LLM(model=spec.model, **kv_gate.decide(spec, out_dir))
        except ValueError as exc:   # what the pre-flight cannot know, e.g. a profiled CUDA pool too small
            field, _, message = str(exc).partition(": ")
            raise spec.fail(("model",) if field == "model" else ("engine", field), message) from exc
        engine, batching = llm.engine, spec.batching
        config = engine.config
        if done and engine.dtype.itemsize == 2 and not config.deterministic:
            log.warning("resuming at %s without engine.deterministic: the rows generated now may differ in the last "
                        "digits (and greedy text after them) from what an uninterrupted run would have given",
                        str(engine.dtype).removeprefix("torch."))
        encoder = PromptEncoder(spec.input, llm.tokenizer, engine.max_model_len)
        eta = EtaEstimator.from_engine(engine, total - len(done), batching, report.read_json(out_dir, report.ETA_STATE))
        feed = RowFeed(source.batches(min(1024, batching.window)), encoder.prepare, batching.window,
                       batching.bucketing, done, batching.longest_first, observe=eta.observe_rows,
                       pilot=batching.pilot)
        in_flight_cap = config.max_num_seqs + (batching.max_waiting or 4 * config.max_num_seqs)
        inflight: dict[str, Row] = {}
        records = RecordMaker(spec)
        progress = Progress(total, len(done), self.tty, spec.output.log_every_s, self._name(), eta, spec.deadline_at,
                            spec.path)
        start, kv_peak = time.perf_counter(), 0
        with self.serve(llm) if self.serve else contextlib.nullcontext() as server:
            while self.stop_reason is None:
                while len(inflight) < in_flight_cap and (item := feed.next()) is not None:
                    order_key, row = item
                    inflight[str(row.index)] = row
                    llm.add_request(row.token_ids, row.params, request_id=str(row.index),
                                    lane=spec.engine.lane, order_key=order_key)
                for row in feed.failed:
                    self._save(sink, records.records(row))
                    progress.row(failed=True, tokens=0)
                feed.failed.clear()
                if not inflight and (server is None or not server.finishing()):
                    break
                try:
                    outs = llm.step()   # also admits served requests and routes their tokens
                except TensorParallelError as exc:   # a rank died: keep what is done, resume on the next submit
                    self.stop_reason = str(exc)
                    break
                for out in outs:
                    if out.prompt_outputs is None:   # the row is done when its last sample is
                        continue
                    outs = out.prompt_outputs
                    row = inflight.pop(out.request_id)
                    saved = records.records(row, outs)
                    self._save(sink, saved)
                    progress.row(failed=all(r["status"] == "error" for r in saved),
                                 tokens=sum(len(o.token_ids) for o in outs),
                                 max_tokens=row.params.max_tokens * row.params.n, prompt_tokens=out.prompt_tokens)
                kv_peak = max(kv_peak, engine.stats.kv_blocks_used)
                if progress.tick(engine, feed.queued):
                    run = self._figures(out_dir, engine, sink, progress, start, kv_peak)
                    run.estimate = progress.estimate()
                    self._report(out_dir, run, eta)
        self._save(sink)
        progress.close()
        report.write_eta_state(out_dir, eta.state())
        if self.stop_reason:
            log.warning("stopped by %s: %d rows saved this run, %d left in flight will run on the next submit",
                        self.stop_reason, sink.rows_written, len(inflight))
        return self._figures(out_dir, engine, sink, progress, start, kv_peak)

    def _figures(self, out_dir: Storage, engine, sink: ResultSink, progress: Progress, start: float,
                 kv_peak: int) -> RunSummary:
        """This run's figures so far, for summary.json."""
        batching, s, wall = self.spec.batching, engine.stats, time.perf_counter() - start
        return RunSummary(rows_this_run=sink.rows_written, wall_s=round(wall, 3),
                          output_tokens_this_run=progress.tokens,
                          output_tokens_per_s=round(progress.tokens / max(wall, 1e-9), 2), preemptions=s.preemptions,
                          kv_blocks_peak=kv_peak, details={
                              "prompt_tokens_processed": s.prompt_tokens,
                              "prefix_cache_hit_tokens": s.prefix_cache_hit_tokens,
                              "kv_blocks_total": engine.num_blocks, "kv_block_size": engine.config.block_size,
                              "kv_bytes_per_token": engine.kv_bytes_per_token, "bucketing": batching.bucketing,
                              "kv_cache_dtype": engine.config.kv_cache_dtype,
                              "compute_dtype": str(engine.dtype).removeprefix("torch."),
                              "deterministic": engine.config.deterministic,
                              "quantization": engine.config.quantization,
                              "kv_quality_gate": kv_gate.saved_decision(out_dir),
                              "longest_first": batching.longest_first})

    def _report(self, out_dir: Storage, run: RunSummary, eta: EtaEstimator | None = None) -> None:
        """While running: summary.json and metrics.prom with the estimate (`batchrun status` and alerts read them),
        and the step records a resumed run starts its estimate from."""
        report.write_summary(out_dir, self._name(), run.as_dict())
        if eta is not None:
            report.write_eta_state(out_dir, eta.state())

    def _save(self, sink: ResultSink, records: list[dict] | None = None) -> None:
        """Add an input row's results (or flush); a write that fails (disk full, output made read-only) stops the
        job as a signal does: nothing more is admitted, and rows not in a complete shard run again on the next
        submit."""
        try:
            sink.add(records) if records is not None else sink.flush()
        except OSError as exc:
            if self.stop_reason is None:
                self.stop_reason = f"a failed write in {sink.store.dir} ({exc.strerror or exc})"

    def _finish(self, out_dir: Storage, sink: ResultSink, run: RunSummary) -> dict:
        out = self.spec.output
        if not self.stop_reason:
            if out.order == "input":
                sink.sort_by_input()
            if out.openai_batch:
                from batchrun.job.openai_batch import write_output
                write_output(sink.store.read(), out_dir, "output.jsonl", self.spec.model)
        failed = report.counts(out_dir)["rows_failed"]
        run.exit_code = EXIT_INTERRUPTED if self.stop_reason else EXIT_FAILED_ROWS if failed else EXIT_OK
        run.status = "interrupted" if self.stop_reason else "done"
        run.estimate = Estimate.at_end(time.time(), self.spec.deadline_at, stopped=bool(self.stop_reason))
        summary = report.write_summary(out_dir, self._name(), run.as_dict())
        log.info("job %s: %s, %d ok, %d failed, %s remaining; summary in %s", self._name(), run.status,
                 summary["rows_ok"], summary["rows_failed"], summary["rows_remaining"], out_dir)
        return summary

    def _signals(self):
        runner = self

        class Handlers:
            def __enter__(self):
                self.saved = {}
                if threading.current_thread() is threading.main_thread():
                    for sig in (signal.SIGTERM, signal.SIGINT):
                        self.saved[sig] = signal.signal(sig, self.handle)

            def handle(self, signum, frame):
                if runner.stop_reason is not None:
                    raise KeyboardInterrupt   # a second signal: stop now (saved shards stay valid)
                runner.stop_reason = signal.Signals(signum).name

            def __exit__(self, *exc):
                for sig, old in self.saved.items():
                    signal.signal(sig, old)
        return Handlers()
