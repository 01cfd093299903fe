"""The check's models from configs: the published shapes, the tokenizer file, the tiny model's clear margins."""
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchrun.gpucheck import identity, models
from conftest import CORPUS, tiny_tokenizer


@pytest.mark.parametrize("name,params", [("llama-1b", 1_235_814_400), ("smollm2-135m", 134_515_008)])
def test_shapes_have_the_published_parameter_counts(name, params):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(models.config(name))
    assert sum(p.numel() for p in model.parameters()) == params   # tied embeddings counted once


def test_tokenizer_file_is_the_tests_tiny_tokenizer():
    tok, reference = models.tokenizer(), tiny_tokenizer()
    assert len(tok) == len(reference) == models.SHAPES["tiny-sharp"][0]["vocab_size"]
    for text in CORPUS + ["unseen words: zebra, 42!"]:
        assert tok(text).input_ids == reference(text).input_ids
    assert (tok.bos_token_id, tok.eos_token_id) == (models.BOS, models.EOS)


def test_build_reuses_a_finished_folder_only(tmp_path):
    path = models.build("llama-1b", tmp_path, toy=True)
    assert os.path.basename(path) == "llama-1b-toy" and os.path.exists(os.path.join(path, "tokenizer.json"))
    stamp = os.path.getmtime(os.path.join(path, "model.safetensors"))
    assert models.build("llama-1b", tmp_path, toy=True) == path
    assert os.path.getmtime(os.path.join(path, "model.safetensors")) == stamp
    os.remove(os.path.join(path, ".complete"))        # as a build stopped half-way leaves it
    models.build("llama-1b", tmp_path, toy=True)
    assert os.path.getmtime(os.path.join(path, "model.safetensors")) != stamp
    with pytest.raises(ValueError, match="unknown name 'llama-2b'; known: tiny-sharp"):
        models.config("llama-2b")


def test_tiny_sharp_model_wins_its_greedy_choices_by_clear_margins(tmp_path):
    """On the identity prompts, over 64 tokens, the top logit leads the second by >= 5e-4 (measured 1.1e-3): float32
    on two devices (rounding near 1e-6 of logits of size 10) cannot flip a choice, so a different token is a bug."""
    model = AutoModelForCausalLM.from_pretrained(models.build("tiny-sharp", tmp_path), dtype=torch.float32).eval()
    prompts = identity.sharp_prompts(32)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])          # left padded, masked
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=64, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    top = torch.stack(out.scores, 1).topk(2, dim=-1).values
    assert (top[..., 0] - top[..., 1]).min().item() >= 5e-4
