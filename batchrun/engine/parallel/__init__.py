"""Tensor parallelism inside one engine replica (Megatron split, as vLLM does it).

Rank 0 is the engine's own process: it runs the scheduler, block manager, sampler and job logic, and sends each
step's forward inputs to the other ranks, worker processes that only run the forward on their slice of the model
(runner.py, worker.py). Every rank holds its heads' paged KV pool with the same block tables. The split
(shard.py): q/k/v and gate/up by output columns, o and down by input rows with one all-reduce each per layer,
embedding and lm_head by vocabulary rows (logits gathered on rank 0), MoE experts by their intermediate size.
Collectives (group.py) run over gloo on the CPU and NCCL on CUDA.
"""


class TensorParallelError(RuntimeError):
    """A rank failed: the engine cannot step any more (a job saves its finished rows and exits to resume)."""
