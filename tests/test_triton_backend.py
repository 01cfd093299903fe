"""The engine on the Triton backend (under TRITON_INTERPRET=1 on CPU) matches the torch backend token for token;
backend selection: auto -> triton on CUDA, torch on CPU."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"   # read when the kernels are decorated: before batchrun imports them
pytest.importorskip("triton")

from batchrun import LLM, SamplingParams  # noqa: E402
from batchrun.engine.attention import TorchAttentionBackend  # noqa: E402
from batchrun.engine.backends import get_backend  # noqa: E402
from batchrun.engine.triton_backend import TritonAttentionBackend  # noqa: E402
from conftest import random_prompts  # noqa: E402


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
def test_engine_steps_match_torch_backend(tiny_model, kv_cache_dtype):
    path, _ = tiny_model
    prompts = random_prompts([5, 23, 40, 1], seed=11)
    prompts.append(prompts[2][:32] + prompts[0])   # two cached blocks: a chunk after a prefix-cache hit
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        # a budget of 24 tokens per step: chunked prefills beside decodes in the same step
        llm = LLM(model=path, attention_backend=backend, kv_cache_memory="4MiB", block_size=16,
                  max_num_batched_tokens=24, kv_cache_dtype=kv_cache_dtype, dtype="float32")
        kind = TritonAttentionBackend if backend == "triton" else TorchAttentionBackend
        assert isinstance(llm.engine.model.model.layers[0].self_attn.backend, kind)
        tokens[backend] = [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["triton"] == tokens["torch"]


def test_backend_choice(monkeypatch):
    assert isinstance(get_backend("auto", torch.device("cpu")), TorchAttentionBackend)
    assert isinstance(get_backend("torch", torch.device("cuda")), TorchAttentionBackend)
    assert isinstance(get_backend("auto", torch.device("cuda")), TritonAttentionBackend)
    if not torch.cuda.is_available():   # the interpreter is on only without CUDA (conftest)
        assert isinstance(get_backend("triton", torch.device("cpu")), TritonAttentionBackend)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="attention_backend: 'triton' runs on CUDA"):
        get_backend("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="allowed: auto, torch, triton"):
        get_backend("flash", torch.device("cpu"))
