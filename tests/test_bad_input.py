"""Bad input gets an error naming the field; a bad request in a batch fails alone."""
import pytest

from batchrun import LLM, EngineConfig, SamplingParams
from conftest import random_prompts


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"), (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k")])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(kv_cache_memory="lots"), "kv_cache_memory: cannot parse 'lots'"),
    (dict(kv_cache_memory="2 parsecs"), "kv_cache_memory"),
    (dict(kv_cache_memory=0), "kv_cache_memory: must be a positive"),
    (dict(kv_cache_dtype="int4"), "kv_cache_dtype: unknown value 'int4'; allowed"),
    (dict(block_size=0), "block_size"), (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(attention_backend="cuda-magic"), "attention_backend"),
    (dict(batch_tokens_while_interactive=0), "batch_tokens_while_interactive: must be a positive integer")])
def test_bad_engine_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_unknown_model_and_option(tmp_path):
    with pytest.raises(ValueError, match="model: 'no-such-model' is neither"):
        LLM(model="no-such-model")
    with pytest.raises(ValueError, match="no config.json"):
        LLM(model=str(tmp_path))
    with pytest.raises(TypeError, match="unknown option.*kv_cache_mem"):
        LLM(model=str(tmp_path), kv_cache_mem="1GiB")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "vocab_size": 10, "n_embd": 8, "n_layer": 1, '
                                          '"n_head": 1}')
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported.*llama, mistral, qwen2"):
        LLM(model=str(tmp_path))


def test_bad_request_fails_alone(tiny_llm):
    too_long = random_prompts([600])[0]   # the tiny model's context is 512
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    outs = tiny_llm.generate([random_prompts([4])[0], too_long, [], [9999]] + random_prompts([6]), params,
                             use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "error", "length"]
    assert "600 tokens does not fit the context of 512" in outs[1].error
    assert "empty prompt" in outs[2].error and "token ids must be integers in" in outs[3].error


def test_pool_smaller_than_one_request_at_max_context(tiny_model):
    # 512 bytes per token in float32: 64 tokens of pool against a context of 512.
    with pytest.raises(ValueError, match=r"kv_cache_memory: .* holds 64 tokens .* less than one request at max "
                                         r"context \(512 tokens.*lower max_model_len to at most 64"):
        LLM(model=tiny_model[0], block_size=4, kv_cache_memory=512 * 64)
    LLM(model=tiny_model[0], block_size=4, kv_cache_memory=512 * 64, max_model_len=64)


def test_token_ids_that_are_not_integers_fail_their_request_alone(tiny_llm):
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for bad in ([1.5, 2], [True, 3], [2**70]):
        request = tiny_llm.engine.add_request(bad, params)
        assert request.finish_reason == "error" and "token ids must be integers" in request.error
    assert [o.finish_reason for o in tiny_llm.generate([[5, 6]], params, use_tqdm=False)] == ["length"]
