"""LoRA adapters per request: greedy tokens equal transformers + PEFT (unmerged and merged) for every adapter, in
one mixed batch with base rows, across chunked prefill and forced preemption; the prefix cache keyed by adapter;
the resident set's LRU; bad adapters refused naming the file and the module."""
import json
import os

import pytest
import torch

from batchrun import LLM, SamplingParams
from conftest import random_prompts, reference_greedy
from lora_kit import ADAPTERS, build, peft_greedy

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build(tmp_path_factory.mktemp("lora-llama"))


def mixed_rows(names, lengths, seed):
    """Prompts with an adapter each, cycling through `names` (None: the base model)."""
    prompts = random_prompts(lengths, seed=seed)
    return [(p, names[i % len(names)]) for i, p in enumerate(prompts)]


def run(llm, rows, max_tokens=MAX_TOKENS):
    params = [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, adapter=a) for _, a in rows]
    outs = llm.generate([p for p, _ in rows], params, use_tqdm=False)
    for out in outs:
        assert out.finish_reason == "length", out.error
    return [out.token_ids for out in outs]


def expected(base, peft_models, rows, merged=False, max_tokens=MAX_TOKENS):
    return [reference_greedy(base, p, max_tokens) if a is None else peft_greedy(peft_models[a], p, max_tokens, merged)
            for p, a in rows]


def check_mixed(path, base, paths, peft_models, seed, merged=False, lengths=(3, 9, 17, 5, 23, 12, 7, 30), **engine):
    llm = LLM(model=path, adapters=paths, **{"kv_cache_memory": "4MiB", **engine})
    rows = mixed_rows([None, *paths], lengths, seed=seed)
    got = run(llm, rows)
    assert got == expected(base, peft_models, rows)
    if merged:
        assert got == expected(base, peft_models, rows, merged=True)
    # every adapter changes the output: the test would see an adapter that is ignored
    assert all(tokens != reference_greedy(base, p, MAX_TOKENS) for tokens, (p, a) in zip(got, rows) if a)
    llm.engine.block_manager.check_integrity()
    return llm


def test_llama_mixed_batch_with_chunked_prefill(llama):
    check_mixed(*llama, seed=1, merged=True, block_size=4, max_num_batched_tokens=16)


def test_llama_forced_preemption(llama):
    llm = check_mixed(*llama, seed=2, block_size=4, max_num_batched_tokens=64, kv_cache_memory="40KiB",
                      max_model_len=64)
    assert llm.engine.stats.preemptions > 0


@pytest.mark.parametrize("way", ["stacked-kernel", "stacked-onednn", "per-adapter"])
def test_each_cpu_update_path_matches_peft(llama, monkeypatch, way):
    """Each CPU way of the grouped update, forced in turn: the stacked shrink over every resident adapter with the
    expand kernel (each run of rows its own adapter's B) or with oneDNN's products (each row's mask zeroing the
    others' columns; steps of at most and of more than FUSED_ADD_ROWS rows), and the per-adapter runs. With
    max_adapters=2 of 3 the stacks are rebuilt as adapters come and go."""
    from batchrun.engine.lora import grouped, resident
    from batchrun.kernels import lora_expand
    stacked = way != "per-adapter"
    if way == "stacked-kernel" and lora_expand.load() is None:
        pytest.skip("the LoRA expand kernel could not be built here")
    if way == "stacked-onednn":
        monkeypatch.setattr(resident.lora_expand, "load", lambda: None)
    monkeypatch.setattr(grouped, "stacked_wins", lambda *args: stacked)
    used = set()
    for cls in (grouped.Stacked, grouped.PerAdapter):
        monkeypatch.setattr(cls, "apply", lambda self, *a, _apply=cls.apply: used.add(type(self)) or _apply(self, *a))
    llm = check_mixed(*llama, seed=11, lengths=(3, 9, 17, 5, 23, 12, 30), block_size=4, max_num_batched_tokens=40,
                      max_adapters=2)
    assert used == {grouped.Stacked if stacked else grouped.PerAdapter}
    adapters = llm.engine.adapters
    assert adapters.loads > 2
    assert all((stack.bt is not None) == (way == "stacked-kernel") for stack in adapters.stacks.values()) \
        if stacked else adapters.stacks is None
    # the stacked way's shrink rides in each projection's base product ([W; stacked A] packed as one matrix)
    fused = [m.fused is not None for m in adapters.projections.values()]
    assert all(fused) if stacked else not any(fused)
    if stacked:   # the memory the engine reserves per adapter is what it really holds
        assert held_elements(adapters) * 4 == sum(adapters.held_bytes(name) for name in adapters.resident)


def held_elements(adapters) -> int:
    """Every value the resident adapters take: their own matrices and the stacks' (A inside the fused weights)."""
    own = sum(w.a.numel() + w.b.numel() for weights in adapters.resident.values() for w in weights.values())
    stacked = 0
    for projection, stack in adapters.stacks.items():
        a = stack.owner.numel() * adapters.shapes[projection][0] if stack.a is None else stack.a.numel()
        stacked += a + sum(t.numel() for t in (stack.bt, stack.b, stack.b_packed) if t is not None)
    return own + stacked


def test_sgmv_kernels_in_the_engine(llama):
    """The CUDA way (the SGMV kernels over each step's segments of rows), run here under the Triton interpreter in
    float32: the same tokens as PEFT, base rows among the adapters' rows, prefill chunks and decodes."""
    pytest.importorskip("triton")
    path, base, paths, peft_models = llama
    llm = LLM(model=path, adapters=paths, kv_cache_memory="4MiB", block_size=4, max_num_batched_tokens=24)
    llm.engine.adapters.segmented = True
    rows = mixed_rows([None, *paths], (3, 19, 9, 5), seed=12)
    got = run(llm, rows, max_tokens=4)
    assert got == expected(base, peft_models, rows, max_tokens=4)
    assert all(tokens != reference_greedy(base, p, 4) for tokens, (p, a) in zip(got, rows) if a)
    assert all(stack.b_packed is None for stack in llm.engine.adapters.stacks.values())
    # one copy: each resident adapter's matrices are views into the stacks the kernels read
    adapters = llm.engine.adapters
    for name, weights in adapters.resident.items():
        for projection, w in weights.items():
            stack = adapters.stacks[projection]
            assert w.a.untyped_storage().data_ptr() == stack.a.untyped_storage().data_ptr()
            assert w.b.untyped_storage().data_ptr() == stack.b.untyped_storage().data_ptr()


def test_qwen3_mixed_batch(tmp_path):
    check_mixed(*build(tmp_path, "qwen3", head_dim=16), seed=3, merged=True, block_size=8, max_num_batched_tokens=24)


def test_qwen2_qkv_bias_in_the_fused_weight(tmp_path):
    """Qwen2's q/k/v bias rides along in the fused [W; stacked A] product (zeros for the shrink's columns)."""
    llm = check_mixed(*build(tmp_path, "qwen2"), seed=31, block_size=8, max_num_batched_tokens=24)
    assert any(m.fused is not None and m.fused_bias is not None for m in llm.engine.adapters.projections.values())


def test_generate_adapter_argument(llama):
    path, base, paths, peft_models = llama
    llm = LLM(model=path, adapters=paths, kv_cache_memory="4MiB")
    prompt = random_prompts([11], seed=4)[0]
    out = llm.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                       use_tqdm=False, adapter="qv")
    assert out[0].token_ids == peft_greedy(peft_models["qv"], prompt, MAX_TOKENS)


def test_prefix_cache_is_keyed_by_adapter(llama):
    path, base, paths, peft_models = llama
    llm = LLM(model=path, adapters=paths, kv_cache_memory="4MiB", block_size=4)
    prompt = random_prompts([25], seed=5)[0]
    alone = {a: run(llm, [(prompt, a)])[0] for a in (None, "support", "invoices")}
    together = run(llm, [(prompt, a) for a in (None, "support", "invoices")])
    assert together == list(alone.values())
    assert len(set(map(tuple, together))) == 3
    assert llm.engine.stats.prefix_cache_hit_tokens > 0   # each adapter hit its own blocks from its first run


def test_lru_keeps_at_most_max_adapters(llama):
    path, base, paths, peft_models = llama
    llm = LLM(model=path, adapters=paths, max_adapters=1, kv_cache_memory="4MiB")
    rows = mixed_rows([None, *paths], [4, 6, 8, 10, 5, 7], seed=6)
    assert run(llm, rows) == expected(base, peft_models, rows)
    assert len(llm.engine.adapters.resident) == 1
    assert llm.engine.adapters.loads == 3   # rows of one adapter at a time: each adapter loaded once


def test_unknown_adapter_fails_that_row_alone(llama):
    path, base, paths, peft_models = llama
    llm = LLM(model=path, adapters=paths, kv_cache_memory="4MiB")
    params = [SamplingParams(max_tokens=2, temperature=0, adapter=a) for a in ("support", "nope", None)]
    outs = llm.generate(random_prompts([5, 5, 5], seed=7), params, use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert "unknown adapter 'nope'" in outs[1].error and "support" in outs[1].error


def _corrupt(tmp_path, llama, name, change):
    """A copy of the 'qv' adapter with `change(config, tensors)` applied; returns its directory."""
    from safetensors.torch import load_file, save_file
    source = llama[2]["qv"]
    target = tmp_path / name
    target.mkdir()
    config = json.load(open(os.path.join(source, "adapter_config.json")))
    tensors = load_file(os.path.join(source, "adapter_model.safetensors"))
    change(config, tensors)
    json.dump(config, open(target / "adapter_config.json", "w"))
    save_file(tensors, str(target / "adapter_model.safetensors"))
    return str(target)


def _rank_mismatch(config, tensors):
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    tensors[key] = torch.zeros(tensors[key].shape[0], 3)


def _wrong_width(config, tensors):
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[key] = torch.zeros(4, 32)


def _unsupported_target(config, tensors):
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 64)
    tensors["base_model.model.lm_head.lora_B.weight"] = torch.zeros(256, 4)


def _dora(config, tensors):
    config["use_dora"] = True


@pytest.mark.parametrize("change, message", [
    (_rank_mismatch, "module 'model.layers.1.self_attn.v_proj': lora_A is [4, 64] and lora_B is [32, 3]"),
    (_wrong_width, "module 'model.layers.0.self_attn.q_proj': lora_A is [4, 32]"),
    (_unsupported_target, "module 'lm_head' is not a supported target"),
    (_dora, "use_dora: True is not supported"),
])
def test_bad_adapter_refused_naming_file_and_module(tmp_path, llama, change, message):
    bad = _corrupt(tmp_path, llama, "bad", change)
    with pytest.raises(ValueError) as err:
        LLM(model=llama[0], adapters={"ok": llama[2]["qv"], "bad": bad}, kv_cache_memory="4MiB")
    assert message in str(err.value) and "adapter 'bad'" in str(err.value) and bad in str(err.value)


def test_missing_adapter_directory(tmp_path, llama):
    with pytest.raises(ValueError, match=r"adapter 'gone': .*adapter_config.json does not exist"):
        LLM(model=llama[0], adapters={"gone": str(tmp_path / "nowhere")}, kv_cache_memory="4MiB")


def test_adapter_for_another_model(tmp_path, llama):
    """An adapter made for a narrower model: the error names the module and the shapes the base needs."""
    other = build(tmp_path, hidden_size=32, adapters={"wide": ADAPTERS["qv"]})
    with pytest.raises(ValueError, match=r"adapter 'wide'.*the base model needs \[r, 64\]"):
        LLM(model=llama[0], adapters=other[2], kv_cache_memory="4MiB")


def test_whole_model_graph(llama, monkeypatch):
    """The CPU default: one compiled graph whose opaque LoRA op reads each step's adapter runs (any mix, one graph)."""
    monkeypatch.setenv("BATCHRUN_COMPILE", "1")
    llm = check_mixed(*llama, seed=8, lengths=(3, 17, 9, 23), block_size=4, max_num_batched_tokens=16)
    assert llm.engine.model._graph is not None


def test_server_model_field_selects_the_adapter(llama):
    openai = pytest.importorskip("openai")
    from batchrun.server import ServerThread, create_app
    path, base, paths, peft_models = llama
    llm = LLM(model=path, adapters=paths, kv_cache_memory="4MiB")
    llm.start_background()
    server = ServerThread(create_app(llm, model_name="tiny")).start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=30)
        assert [m.id for m in client.models.list().data] == ["tiny", *paths]
        prompt = random_prompts([9], seed=9)[0]
        for model, want in (("tiny", reference_greedy(base, prompt, 5)),
                            ("support", peft_greedy(peft_models["support"], prompt, 5))):
            r = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.model == model and r.choices[0].text == llm.tokenizer.decode(want, skip_special_tokens=True)
        with pytest.raises(openai.NotFoundError, match="'nope' is not served here; this server serves 'tiny', "
                                                       "'support'"):
            client.completions.create(model="nope", prompt=prompt, max_tokens=2)
    finally:
        server.stop()
        llm.stop_background()


def test_serve_command_takes_adapters(llama, monkeypatch):
    """`batchrun serve --adapter NAME=PATH`: the command's engine holds the adapters and the served app selects
    one by the request's `model` (uvicorn.run replaced by a server thread that the test queries)."""
    openai = pytest.importorskip("openai")
    uvicorn = pytest.importorskip("uvicorn")
    from click.testing import CliRunner
    from transformers import AutoTokenizer

    from batchrun.cli import main
    from batchrun.server import ServerThread
    path, base, paths, peft_models = llama
    prompt = random_prompts([7], seed=13)[0]
    answers = {}

    def serve_briefly(app, **kwargs):
        server = ServerThread(app).start()
        try:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=30)
            answers["models"] = [m.id for m in client.models.list().data]
            for model in ("tiny", "qv"):
                answers[model] = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0,
                                                           extra_body={"ignore_eos": True}).choices[0].text
        finally:
            server.stop()
    monkeypatch.setattr(uvicorn, "run", serve_briefly)
    result = CliRunner().invoke(main, ["serve", "--model", path, "--served-model-name", "tiny", "--kv-cache-memory",
                                       "4MiB", "--adapter", f"qv={paths['qv']}",
                                       "--adapter", f"support = {paths['support']}"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert answers["models"] == ["tiny", "qv", "support"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert answers["tiny"] == tokenizer.decode(reference_greedy(base, prompt, 4), skip_special_tokens=True)
    assert answers["qv"] == tokenizer.decode(peft_greedy(peft_models["qv"], prompt, 4), skip_special_tokens=True)
    assert answers["qv"] != answers["tiny"]


def test_serve_command_refuses_a_bad_adapter_option(llama, tmp_path):
    from click.testing import CliRunner

    from batchrun.cli import main
    bad = CliRunner().invoke(main, ["serve", "--model", llama[0], "--adapter", "support"])
    assert bad.exit_code == 2 and "'support': expected NAME=PATH" in bad.output
    missing = CliRunner().invoke(main, ["serve", "--model", llama[0], "--kv-cache-memory", "4MiB",
                                        "--adapter", f"gone={tmp_path / 'nowhere'}"])
    assert missing.exit_code == 2 and "adapter 'gone'" in missing.output and "does not exist" in missing.output
