"""Shared fixtures: tiny randomly initialised Llama-family models saved as safetensors, with a tokenizer."""
from __future__ import annotations

import copy
import os

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast
from transformers import LlamaConfig, MistralConfig, Qwen2Config

# Exactness tests compare with transformers in float32: `dtype: auto` must not pick bfloat16 on a CPU with native
# bf16 (an environment variable, so the CLI subprocesses of the job tests inherit it).
os.environ["BATCHRUN_CPU_DTYPE"] = "float32"
# The suite builds hundreds of engines: compiling a whole-model graph for each would cost seconds apiece. Elementwise
# pieces only, here; tests/test_whole_graph.py covers the graph (the CPU default).
os.environ.setdefault("BATCHRUN_COMPILE", "ops")
# Triton reads TRITON_INTERPRET when a kernel is decorated; torch.compile imports Triton early, so set it here, before
# any test module (the Triton kernels run on CPU tensors only under the interpreter).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

VOCAB = 256
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Summarize the following text in one sentence.",
          "What is the capital of France? Paris is the capital.", "Batch inference keeps the GPU busy all night."]


def tiny_config(model_type: str = "llama", **overrides):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.2, eos_token_id=2, bos_token_id=1, tie_word_embeddings=False)
    common.update(overrides)
    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}
    return classes[model_type](**common) if model_type in classes else AutoConfig.for_model(model_type, **common)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 10, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_model(path, model_type: str = "llama", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides)).eval()
    model.save_pretrained(path, safe_serialization=True)
    tiny_tokenizer().save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """(directory, transformers model) of a tiny random Llama."""
    path = tmp_path_factory.mktemp("tiny-llama")
    return str(path), save_tiny_model(path)


@pytest.fixture(scope="session")
def tiny_llm(tiny_model):
    from batchrun import LLM
    return LLM(model=tiny_model[0], kv_cache_memory="4MiB", block_size=4, max_num_batched_tokens=64)


def reference_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers generate, greedy, float32, EOS ignored (not suppressed)."""
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = VOCAB   # an id the model never produces: run to max_new_tokens
    out = model.generate(torch.tensor([prompt]), generation_config=config, max_new_tokens=max_tokens,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def random_prompts(lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A SeaweedFS S3 server on 127.0.0.1 (tests/s3kit.py); skipped with the reason when it cannot start."""
    from s3kit import S3Server, ServerUnavailable
    server = S3Server(str(tmp_path_factory.mktemp("seaweedfs")))
    try:
        server.start()
    except ServerUnavailable as exc:
        pytest.skip(str(exc))
    yield server
    server.stop()
