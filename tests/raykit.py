"""A local Ray cluster for the executor tests: a head and two worker nodes of one CPU each."""
import os

import pytest

# before ray is imported: every Ray listener on 127.0.0.1 (also for the drivers started as subprocesses)
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray")
# the replicas (through the cluster's processes) and the local reference: eager torch, no compile or kernel build at
# start-up, so a replica starts in seconds; both run the same math
ENGINE_ENV = {"BATCHRUN_COMPILE": "0", "BATCHRUN_CPU_KERNELS": "0"}


def local_cluster(env: dict):
    """Yields (cluster, worker nodes) with `env` in every node's processes (and so in the replicas), then shuts it
    down; for a module-scoped fixture."""
    from ray.cluster_utils import Cluster
    node = dict(num_cpus=1, object_store_memory=80 << 20)
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        c = Cluster(initialize_head=True, head_node_args=dict(**node, include_dashboard=False))
        workers = [c.add_node(**node) for _ in range(2)]
        c.wait_for_nodes()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    ray.init(address=c.address, logging_level="WARNING")
    yield c, workers
    ray.shutdown()
    c.shutdown()
