"""Deterministic mode: a row's logprobs are bit-identical alone, in a batch of 32, one sequence at a time, in prefill
chunks of 16 tokens and after a prefix-cache hit; at float32 and bfloat16, on two model families."""
from __future__ import annotations

import pytest
import torch

from batchrun import LLM, SamplingParams
from batchrun.engine.row_attention import row_tables
from batchrun.attention_metadata import AttentionMetadata, DecodeGroup, PrefillChunk
from batchrun.models import cpu_gemm, row_tiles
from conftest import random_prompts, save_tiny_model

PROMPTS = random_prompts([5, 9, 17, 23, 31, 40], seed=3)
FILLER = random_prompts([3 + (i * 7) % 45 for i in range(32 - len(PROMPTS))], seed=4)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, ignore_eos=True)
ENGINE = dict(kv_cache_memory="8MiB", block_size=4, max_num_batched_tokens=256, deterministic=True)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"det-{request.param}")
    # wider than the suite's usual tiny model: more terms per dot product, more room for order to show
    save_tiny_model(path, request.param, seed=5, hidden_size=128, intermediate_size=384, num_attention_heads=4,
                    num_key_value_heads=2)
    return str(path)


def _rows(llm: LLM, prompts) -> list[tuple[list[int], list[float]]]:
    return [(out.token_ids, out.logprobs) for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_do_not_depend_on_their_step(family_model, dtype):
    llm = LLM(model=family_model, dtype=dtype, **ENGINE)
    alone = [_rows(llm, [p])[0] for p in PROMPTS]
    assert _rows(llm, PROMPTS + FILLER)[:len(PROMPTS)] == alone, "batch of 32"
    hits = llm.engine.block_manager.prefix_hits
    assert _rows(llm, PROMPTS) == alone, "prefix-cache hit"
    assert llm.engine.block_manager.prefix_hits > hits, "the second run did not hit the prefix cache"
    one_seq = LLM(model=family_model, dtype=dtype, **{**ENGINE, "max_num_seqs": 1})
    assert _rows(one_seq, PROMPTS) == alone, "max_num_seqs 1"
    del one_seq
    chunked = LLM(model=family_model, dtype=dtype, **{**ENGINE, "max_num_batched_tokens": 16})
    assert _rows(chunked, PROMPTS + FILLER)[:len(PROMPTS)] == alone, "prefill chunks of 16 tokens"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_product_gives_a_row_the_same_bits_at_any_place_and_count(dtype):
    torch.manual_seed(0)
    weight = torch.randn(1000, 576, dtype=dtype) * 0.05
    packed = cpu_gemm.pack(weight)
    x = torch.randn(200, 576, dtype=dtype)
    product = ((lambda rows, tile: cpu_gemm.linear(rows, packed, None, tile)) if packed is not None
               else (lambda rows, tile: row_tiles.tiled(lambda t: torch.nn.functional.linear(t, weight), rows, tile)))
    tile = row_tiles.DEFAULT_TILE
    alone = product(x[:1], tile)
    for count in (2, tile - 1, tile, tile + 1, 200):
        for place in {0, count // 2, count - 1}:
            rows = torch.randn(count, 576, dtype=dtype)
            rows[place] = x[0]
            assert torch.equal(product(rows, tile)[place], alone[0]), (count, place)


def test_row_tables_give_every_prefill_query_its_own_context():
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(6, dtype=torch.long),
        decode_groups=[DecodeGroup(0, 2, torch.tensor([[7, 8], [9, 0]]), torch.tensor([6, 3]), 6)],
        prefills=[PrefillChunk(2, 4, 10, torch.tensor([1, 2, 3]))])
    rows = row_tables(meta, 6, torch.device("cpu"))
    assert rows.context_lens.tolist() == [6, 3, 7, 8, 9, 10]
    assert rows.block_tables.tolist() == [[7, 8, 0], [9, 0, 0]] + [[1, 2, 3]] * 4
    assert rows.max_len == 10
    bad = AttentionMetadata(slot_mapping=torch.zeros(5, dtype=torch.long), prefills=meta.prefills)
    with pytest.raises(ValueError, match="back to back"):
        row_tables(bad, 5, torch.device("cpu"))


@pytest.mark.slow   # about 45 s on 2 cores: the graph's compile
def test_whole_model_graph_keeps_rows_invariant(family_model, monkeypatch):
    """The CPU default runs the forward as one compiled graph: its norms and RoPE must also work row by row."""
    if "qwen2" in family_model:
        pytest.skip("one family is enough for the graph (each compile costs seconds)")
    monkeypatch.setenv("BATCHRUN_COMPILE", "1")
    llm = LLM(model=family_model, dtype="bfloat16", **{**ENGINE, "max_num_batched_tokens": 16})
    assert llm.engine.model._graph is not None, "the engine did not compile the whole-model graph"
    alone = [_rows(llm, [p])[0] for p in PROMPTS[:3]]
    assert _rows(llm, PROMPTS[:3] + FILLER)[:3] == alone


def test_job_identity_and_entry_points_carry_the_mode(tmp_path, tiny_model, monkeypatch):
    from click.testing import CliRunner

    import batchrun.engine.llm as llm_module
    from batchrun.cli import main
    from batchrun.job.spec import JobSpec
    from jobkit import write_prompts
    write_prompts(tmp_path / "in.parquet", 2)
    base = {"model": tiny_model[0], "input": {"path": str(tmp_path / "in.parquet")},
            "output": {"path": str(tmp_path / "out")}}
    off, on = JobSpec(base), JobSpec({**base, "engine": {"deterministic": True}})
    assert "deterministic" not in off.identity_fields(), "jobs written before the mode keep their identity"
    assert on.identity_fields()["deterministic"] is True and on.identity() != off.identity()
    assert on.engine_options["deterministic"] is True and "deterministic" not in off.engine_options
    seen = []

    def record(config, admission_key=None):
        seen.append(config.deterministic)
        raise RuntimeError("built")
    monkeypatch.setattr(llm_module, "Engine", record)
    CliRunner().invoke(main, ["serve", "--model", tiny_model[0], "--deterministic"])
    CliRunner().invoke(main, ["serve", "--model", tiny_model[0]])
    assert seen == [True, False]
