"""engine.quantization_lm_head: the LM head quantized at load with the layers, an embedding tied to it held as
int8 rows; a checkpoint's own quantized LM head; and the load-time quantizer's row chunks
(checkpoints.quantize_by_rows), which keep a large table from being read whole."""
import copy

import pytest
import torch
from safetensors.torch import save_file

from batchrun import LLM, Job
from batchrun.engine.loader import SafetensorsReader, Tensors
from batchrun.job.errors import JobError
from batchrun.quant import checkpoints, quantize
from conftest import reference_greedy, save_tiny_model
from jobkit import write_job, write_prompts
from quantkit import block_hadamard, quantize_activations, quantized_input, write_quantized
from test_quant import CHECKPOINTS, GREEDY, PROMPTS, run, write_config


def dequantized_reference(model, quantization: str, rotated: bool, tied: bool):
    """transformers' float32 model on the weights batchrun holds: each projection and the LM head dequantized from
    their (rotated) codes, a tied embedding from its own int8 rows; W8A8 inputs quantized the same way."""
    quantizer = {"int8": quantize.int8_per_channel, "int8-w8a16": quantize.int8_per_channel,
                 "fp8": quantize.fp8_per_channel, "int4": quantize.int4_grouped}[quantization]
    reference = copy.deepcopy(model)
    with torch.no_grad():
        embedding = reference.model.embed_tokens.weight.detach().clone()
        for name, module in model.named_modules():
            if (name.startswith("model.layers.") or name == "lm_head") and isinstance(module, torch.nn.Linear):
                w = module.weight.detach()
                h = block_hadamard(w.shape[1]) if rotated else torch.eye(w.shape[1])
                reference.get_submodule(name).weight = torch.nn.Parameter(quantizer(w @ h).dequantize() @ h)
        if tied:   # the head has its own parameter now; the embedding reads int8 rows of the same table
            reference.model.embed_tokens.weight.copy_(quantize.int8_per_channel(embedding).dequantize())
    activations = {"int8": "int8", "fp8": "fp8"}.get(quantization)
    if activations:
        quantize_activations(reference, activations, rotated=rotated, lm_head=True)
    return reference


@pytest.mark.parametrize("quantization,rotated,tied", [
    ("int8", True, True), ("int8", True, False), ("int8-w8a16", True, True), ("fp8", False, True),
    ("int4", False, False)])
def test_a_quantized_lm_head_runs_greedy_as_transformers_on_the_dequantized_weights(tmp_path, quantization,
                                                                                    rotated, tied):
    model = save_tiny_model(tmp_path, tie_word_embeddings=tied)
    llm, tokens = run(tmp_path, quantization=quantization, quantization_lm_head=True)
    reference = dequantized_reference(model, quantization, rotated, tied)
    assert tokens == [reference_greedy(reference, p, GREEDY.max_tokens) for p in PROMPTS]
    head, embedding = llm.engine.model.lm_head, llm.engine.model.model.embed_tokens
    assert head.quantized is not None and head.weight.numel() == 0
    assert "LM head included" in head.quantized.description
    if tied:   # one int8 table for the lookup, no 16-bit copy
        assert embedding.weight.numel() == 0 and embedding.codes.dtype == torch.int8
        assert embedding.codes.shape == (model.config.vocab_size, model.config.hidden_size)
    else:
        assert embedding.codes is None and embedding.weight.shape == model.model.embed_tokens.weight.shape


@pytest.mark.parametrize("case,tied", [
    ("ct-int8-w8a8-channel", False), ("ct-fp8-w8a16-channel", True), ("ct-int4-w4a16-group", False),
    ("awq-gemm", False), ("gptq-asym-act-order", True)])
def test_a_checkpoints_quantized_lm_head_is_read_as_published(tmp_path, case, tied):
    fmt, opts, activations = CHECKPOINTS[case]
    reference, dequantized, input_scales = write_quantized(tmp_path, fmt, head=True, tie=tied, **opts)
    llm, tokens = run(tmp_path)
    head, embedding = llm.engine.model.lm_head, llm.engine.model.model.embed_tokens
    assert head.quantized is not None and head.weight.numel() == 0
    x = torch.randn(3, head.in_features)
    expected = (x if activations is None else quantized_input(x, activations)) @ dequantized["lm_head"].t()
    torch.testing.assert_close(head(x), expected, atol=1e-4, rtol=1e-4)
    assert embedding.codes is None and embedding.weight.shape == reference.model.embed_tokens.weight.shape
    if activations:
        quantize_activations(reference, activations, input_scales, lm_head=True)
    assert tokens == [reference_greedy(reference, p, GREEDY.max_tokens) for p in PROMPTS]


def test_the_head_is_left_alone_by_default_and_runs_in_the_whole_graph(tmp_path, monkeypatch):
    save_tiny_model(tmp_path, tie_word_embeddings=True)
    llm, _ = run(tmp_path, quantization="int8")
    assert llm.engine.model.lm_head.quantized is None and llm.engine.model.model.embed_tokens.codes is None
    llm, per_op = run(tmp_path, quantization="int8", quantization_lm_head=True)
    monkeypatch.setenv("BATCHRUN_COMPILE", "1")
    compiled, tokens = run(tmp_path, quantization="int8", quantization_lm_head=True)
    assert compiled.engine.model._graph is not None and tokens == per_op


def test_without_load_time_quantization_the_head_option_is_refused_or_idle(tmp_path):
    save_tiny_model(tmp_path / "plain")
    llm, _ = run(tmp_path / "plain", quantization_lm_head=True)   # nothing quantized at load: float weights
    assert llm.engine.quant_scheme is None and llm.engine.model.lm_head.quantized is None
    path = write_config(tmp_path / "awq", {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"})
    with pytest.raises(ValueError, match="quantization_lm_head: the checkpoint is already quantized .'awq'"):
        LLM(model=str(path), kv_cache_memory="4MiB", quantization_lm_head=True)
    with pytest.raises(ValueError, match="quantization_lm_head: must be true or false, got 'yes'"):
        LLM(model=str(path), quantization_lm_head="yes")
    (tmp_path / "in").mkdir()
    write_prompts(tmp_path / "in" / "in.parquet", 2)
    job = write_job(tmp_path / "in", str(path), engine={"quantization_lm_head": True})
    with pytest.raises(JobError, match=r"engine.quantization_lm_head \(line \d+\): the checkpoint is already"):
        Job.from_yaml(job).validate()


@pytest.mark.parametrize("quantizer", [
    lambda w: quantize.int8_per_channel(w, "int8", rotate_input=True), quantize.fp8_per_channel,
    quantize.int4_grouped], ids=["int8-rotated", "fp8", "int4"])
def test_row_chunks_quantize_exactly_as_the_whole_tensor(tmp_path, monkeypatch, quantizer):
    torch.manual_seed(0)
    w = (torch.randn(37, 128) * torch.rand(37, 1)).to(torch.bfloat16)
    save_file({"w": w}, str(tmp_path / "t.safetensors"))
    monkeypatch.setattr(checkpoints, "CHUNK_BYTES", 5 * 128 * 4)   # 5 rows a chunk, the last one 2
    with open(tmp_path / "t.safetensors", "rb") as f:
        chunked = checkpoints.quantize_by_rows(Tensors(str(tmp_path), [SafetensorsReader(f)]), "w", quantizer)
    whole = quantizer(w)
    assert (chunked.rotation, chunked.group_size) == (whole.rotation, whole.group_size)
    if whole.rotation is not None:   # the rotation's product rounds by its row count: the last bits of a scale
        torch.testing.assert_close(chunked.scale, whole.scale, rtol=1e-6, atol=0)
        assert (chunked.data.int() - whole.data.int()).abs().max() <= 1
        return
    bits = (lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)   # fp8 has no equality op
    assert torch.equal(bits(chunked.data), bits(whole.data)) and torch.equal(chunked.scale, whole.scale)
    assert (chunked.zeros is None and whole.zeros is None) or torch.equal(chunked.zeros, whole.zeros)
