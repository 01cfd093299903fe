"""The whole-model torch.compile graph (models/graph.py, the CPU default) keeps greedy float32 outputs identical to
transformers: on the tiny Llama across block boundaries, chunked prefill and prefix-cache hits, and on every dense
family. The rest of the suite runs per op (conftest sets BATCHRUN_COMPILE=ops: a graph per engine costs seconds)."""
import pytest

from batchrun import LLM, SamplingParams
from conftest import random_prompts, save_tiny_model
from test_engine_matches_transformers import assert_matches
from test_model_families import FAMILIES, check, reference


@pytest.fixture(autouse=True)
def whole_graph(monkeypatch):
    monkeypatch.setenv("BATCHRUN_COMPILE", "1")


def graph_llm(path, **kwargs) -> LLM:
    llm = LLM(model=path, kv_cache_memory="4MiB", **kwargs)
    assert llm.engine.model._graph is not None, "the engine did not compile the whole-model graph"
    return llm


def test_llama_block_boundaries_chunks_and_prefix_hits(tiny_model):
    path, model = tiny_model
    llm = graph_llm(path, block_size=4, max_num_batched_tokens=7)
    system = random_prompts([21], seed=7)[0]
    prompts = random_prompts([1, 3, 4, 5, 14, 30], seed=4) + [system + t for t in random_prompts([3, 1, 8], seed=8)]
    assert_matches(llm, model, prompts[:7])
    assert_matches(llm, model, prompts[7:])   # after the first shared-prefix request: cache hits
    assert llm.engine.stats.prefix_cache_hit_tokens > 0


@pytest.mark.parametrize("name", [name for name, (kind, _) in FAMILIES.items() if kind not in ("mixtral", "qwen3_moe")])
def test_dense_families(tmp_path, name):
    model_type, overrides = FAMILIES[name]
    model = save_tiny_model(tmp_path, model_type, seed=1, **overrides)
    prompts = random_prompts([5, 19, 33], seed=2)
    check(graph_llm(str(tmp_path), block_size=8, max_num_batched_tokens=256), prompts,
          [reference(model, p) for p in prompts], logprobs=True)


def test_moe_keeps_the_per_op_path(tmp_path):
    """Expert routing has data-dependent shapes: MoE families run per op even with the graph switched on."""
    save_tiny_model(tmp_path, "mixtral", seed=1, **FAMILIES["mixtral"][1])
    assert LLM(model=str(tmp_path), kv_cache_memory="4MiB").engine.model._graph is None


def test_the_graph_is_built_before_the_first_step(tiny_model):
    """The engine compiles at start-up (a warm-up through prefill, a cached prefix and decode), so a job's steps,
    its ETA and calibration never count the compile; the warm-up leaves no ids, steps or cache hits behind."""
    from torch._dynamo.utils import counters
    path, model = tiny_model
    compiled = counters["stats"]["unique_graphs"]
    llm = graph_llm(path, block_size=4, max_num_batched_tokens=7)
    assert counters["stats"]["unique_graphs"] > compiled, "nothing was compiled at start-up"
    stats = llm.engine.stats
    assert stats.step == 0 and stats.prefix_cache_hit_tokens == 0
    compiled = counters["stats"]["unique_graphs"]
    outputs = llm.generate(random_prompts([1, 5], seed=6), SamplingParams(max_tokens=2), use_tqdm=False)
    assert [o.request_id for o in outputs] == ["0", "1"]
    assert_matches(llm, model, random_prompts([1, 5, 14, 30], seed=5))
    assert counters["stats"]["unique_graphs"] == compiled, "a real step compiled again"
