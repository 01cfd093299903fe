"""`executor: {kind: ray}`: the job's rows through a pool of engine replicas on Ray Data.

The driver does what a local run does around the engine (checks, lock, claim, done ids, summary, exit code: the
JobRunner's code) and replaces the engine loop with a Ray Data pipeline: the input's row groups (done rows left
out, ray_source.py) → map_batches(ReplicaEngine, ActorPoolStrategy) (ray_replica.py), each batch committed by its
replica as one of batchrun's own shards. The driver reads back one row of figures per batch: progress in rows and
output tokens, and per-replica figures for summary.json.
"""
from __future__ import annotations

import logging
import os
import socket
import uuid

from batchrun.job import kv_gate
from batchrun.job.ray_progress import RayProgress
from batchrun.job.run_summary import RunSummary
from batchrun.job.runner import JobRunner
from batchrun.job.sink import ResultSink
from batchrun.job.source import ParquetSource
from batchrun.job.spec import JobSpec
from batchrun.job.storage import Storage, is_uri

log = logging.getLogger("batchrun.job")
EXTRA_HINT = "pip install 'batchrun[ray]'"
CONNECT_TIMEOUT_S = 10


def host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of an address that names one ("HOST:PORT", "ray://HOST:PORT"); None for auto or local."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    return (host.strip("[]"), int(port)) if sep and host and port.isdigit() else None


def import_ray(spec: JobSpec):
    """ray, or a JobError naming the extra. A Ray started here, or one reached on the loopback address, keeps its
    listeners on 127.0.0.1: Ray reads that flag when it is first imported."""
    address = spec.executor.address
    target = host_port(address) if address else None
    if address is None or (target and target[0] in ("127.0.0.1", "localhost", "::1")):
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
        import ray.data   # noqa: F401  (ray without the data extra has no ray.data)
    except ImportError as exc:
        raise spec.fail(("executor", "kind"), f"ray needs Ray Data, which is not installed ({exc}); "
                                              f"{EXTRA_HINT}") from None
    return ray


class RayJobRunner(JobRunner):
    def run(self) -> tuple[str, dict]:
        spec = self.spec
        if self.serve is not None:
            raise spec.fail(("executor", "kind"), "--serve runs beside a local job; use executor kind local")
        if spec.input.format != "parquet":
            raise spec.fail(("input", "format"), "the Ray executor reads Parquet input; run OpenAI batch JSONL "
                                                 "with executor kind local")
        self.ray = import_ray(spec)
        started_here = self._connect()
        try:
            self._check_cluster()
            return super().run()
        finally:
            if started_here:
                self.ray.shutdown()

    def _connect(self) -> bool:
        """Connect (or start a local Ray); True when this call did, so the run disconnects at the end."""
        ray, ex = self.ray, self.spec.executor
        if ray.is_initialized():   # a notebook or test already connected: use that cluster
            return False
        hi = ex.replica_range[1]
        target = host_port(ex.address) if ex.address else None
        if target:   # ray.init retries an unreachable address for minutes
            try:
                socket.create_connection(target, timeout=CONNECT_TIMEOUT_S).close()
            except OSError as exc:
                raise self.spec.fail(("executor", "address"), f"nothing answers at {ex.address} ({exc}); start Ray "
                                                              f"there (ray start --head) or fix the address") from None
        options = {"logging_level": logging.WARNING}
        if ex.address is None:   # a local Ray, sized in logical CPUs so the readers are never starved by replicas
            options.update(num_cpus=max(os.cpu_count() or 1, int(hi * ex.cpus_per_replica) + 1),
                           include_dashboard=False)
        try:
            ray.init(address=ex.address, **options)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise self.spec.fail(("executor", "address"), f"cannot connect to Ray at {ex.address!r} ({exc}); "
                                                          f"start it (ray start --head) or fix the address") from None
        return True

    def _check_cluster(self) -> None:
        """Refuse, before any work, a pool the cluster cannot hold or local paths on a multi-host cluster."""
        ray, spec, ex = self.ray, self.spec, self.spec.executor
        have = ray.cluster_resources()
        hi = ex.replica_range[1]
        need = {"CPU": hi * ex.cpus_per_replica, "GPU": hi * ex.gpus_per_replica}
        if ex.accelerator_type:
            need[f"accelerator_type:{ex.accelerator_type}"] = 0.001 * hi
        for resource, amount in need.items():
            if amount > have.get(resource, 0):
                raise spec.fail(("executor", "replicas"), f"{hi} replicas need {amount:g} {resource} in all, the "
                                                          f"cluster has {have.get(resource, 0):g}; lower replicas "
                                                          f"or the per-replica resources")
        hosts = {node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}
        on_uris = is_uri(spec.resolve(spec.input.path)) and is_uri(spec.resolve(spec.output.path))
        if len(hosts) > 1 and not ex.shared_filesystem and not on_uris:
            raise spec.fail(("executor", "shared_filesystem"),
                            f"the cluster spans {len(hosts)} hosts ({', '.join(sorted(hosts))}) but "
                            f"input.path and output.path are not both URIs; put them on an object store (s3://, "
                            f"gs://...) or on storage every node mounts at the same path and set "
                            f"executor.shared_filesystem: true")

    def _generate(self, source: ParquetSource, sink: ResultSink, done: set[int], total: int,
                  out_dir: Storage) -> RunSummary:
        from ray.data import ActorPoolStrategy, DataContext

        from batchrun.job.ray_replica import RUN_TOKEN, ReplicaEngine
        from batchrun.job.ray_source import JobInput
        spec, ex = self.spec, self.spec.executor
        options = kv_gate.decide(spec, out_dir)
        # a new run token first, then the done ids: a replica of an earlier, killed driver commits nothing after it
        token = uuid.uuid4().hex
        out_dir.write(RUN_TOKEN, token)
        done = sink.store.done_indices()
        DataContext.get_current().enable_progress_bars = False   # Ray's bars count blocks; ours count rows
        lo, hi = ex.replica_range
        results = self.ray.data.read_datasource(JobInput(source.files, source.columns(), spec.input.limit, done,
                                                         spec.storage.options),
                                                num_cpus=0).map_batches(
            ReplicaEngine, batch_size=ex.batch_size, batch_format="pyarrow",
            fn_constructor_args=(spec, options, out_dir, sink.schema, sink.seq, token,
                                 max(1, round(ex.cpus_per_replica))),
            compute=ActorPoolStrategy(min_size=lo, max_size=hi, max_concurrent_calls_per_actor=ex.max_batches_in_flight,
                                      max_tasks_in_flight_per_actor=ex.max_batches_in_flight),
            num_cpus=ex.cpus_per_replica, num_gpus=ex.gpus_per_replica, accelerator_type=ex.accelerator_type)
        progress = RayProgress(total, len(done), self.tty, spec.output.log_every_s, self._name())
        log.info("ray: %s replicas, %g CPU and %g GPU each, %d batches in flight per replica, %d rows to run",
                 lo if lo == hi else f"{lo}-{hi}", ex.cpus_per_replica, ex.gpus_per_replica,
                 ex.max_batches_in_flight, total - len(done))
        try:
            for batch in results.iter_batches(batch_size=None, batch_format="pyarrow"):
                if progress.update(batch.to_pylist()):
                    self._report(out_dir, progress.summary())
                if self.stop_reason:
                    break
        finally:
            if self.stop_reason:   # batches still running commit nothing: their rows run on the next submit
                out_dir.write(RUN_TOKEN, "stopped")
            progress.close()
        # the shards are the record: a batch may commit before its figures reach the driver
        committed = len(sink.store.done_indices()) - len(done)
        if self.stop_reason:
            log.warning("stopped by %s: %d rows saved this run; batches in flight run again on the next submit",
                        self.stop_reason, committed)
        run = progress.summary()
        run.rows_this_run = committed
        return run
