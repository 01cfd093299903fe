"""The engine on CUDA (Triton backend, float32) against the CPU (torch backend, float32) on the tiny sharp model:
the same greedy tokens and logprobs. Its choices win by >= 5e-4 in the logits (test_gpucheck_models.py), so a
different token is a bug in the CUDA path, not a tie broken by rounding."""
import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from batchrun import LLM, SamplingParams  # noqa: E402
from batchrun.engine.triton_backend import TritonAttentionBackend  # noqa: E402
from batchrun.gpucheck import identity, models  # noqa: E402

TOKENS = 32


@pytest.fixture(scope="module")
def sharp(tmp_path_factory):
    return models.build("tiny-sharp", tmp_path_factory.mktemp("models"), device="cpu")


def generate(path: str, device: str, prompts: list[list[int]]) -> list:
    # 64 tokens a step: prompts are prefilled in chunks beside other requests' decodes
    llm = LLM(model=path, device=device, dtype="float32", kv_cache_memory="64MiB", block_size=16,
              max_num_batched_tokens=64)
    if device == "cuda":
        assert isinstance(llm.engine.model.model.layers[0].self_attn.backend, TritonAttentionBackend)
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True, logprobs=True)
    return llm.generate(prompts, params, use_tqdm=False)


def test_cuda_float32_matches_cpu_float32(sharp):
    prompts = identity.sharp_prompts(16)   # their margins are measured (a prefix-cache hit on CUDA: test_triton_backend)
    cpu, cuda = generate(sharp, "cpu", prompts), generate(sharp, "cuda", prompts)
    assert [o.token_ids for o in cuda] == [o.token_ids for o in cpu]
    assert all(len(o.token_ids) == TOKENS for o in cuda)
    worst = max(abs(a - b) for c, g in zip(cpu, cuda) for a, b in zip(c.logprobs, g.logprobs))
    assert worst < 1e-3, f"logprobs differ by up to {worst:.2e}"
