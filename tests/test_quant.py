"""Quantized weights (batchrun/quant): each format's loaded layers equal the dequantized reference, greedy tokens
of a quantized tiny model equal transformers' float32 run on the same dequantized weights (with the activations
quantized the same way for W8A8), and formats batchrun does not run are refused from config.json alone."""
import copy
import json
import time

import pytest
import torch

from batchrun import LLM, SamplingParams
from batchrun.kernels import amx_linear
from batchrun.quant import cpu_kernels, quantize
from batchrun.quant.formats import scheme_for
from batchrun.cpuinfo import cpu_flags
from batchrun.quant.linear import QuantizedLinear, cpu_kernel_name
from batchrun.quant.weights import pack_int4, unpack_int4
from conftest import random_prompts, reference_greedy, save_tiny_model, tiny_config
from quantkit import block_hadamard, quantize_activations, quantized_input, write_quantized

PROMPTS = random_prompts([5, 19, 33], seed=2)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def run(path, **options) -> tuple[LLM, list[list[int]]]:
    llm = LLM(model=str(path), kv_cache_memory="4MiB", block_size=4, dtype="float32", **options)
    return llm, [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def assert_greedy_matches(llm_tokens, reference):
    assert llm_tokens == [reference_greedy(reference, p, GREEDY.max_tokens) for p in PROMPTS]


def hf_layers(llm: LLM, dequantized: dict[str, torch.Tensor]):
    """(quantized Linear, its dequantized reference weight [N, K]) per fused layer of layer 0."""
    layers = llm.engine.model.model.layers[0]
    fused = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "self_attn.o_proj": ("self_attn.o_proj",), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
             "mlp.down_proj": ("mlp.down_proj",)}
    for name, parts in fused.items():
        yield layers.get_submodule(name), torch.cat([dequantized[f"model.layers.0.{p}"] for p in parts])


# --- quantization math and kernels ---

def test_load_time_quantization_is_within_half_a_step():
    w = torch.randn(96, 256) * torch.rand(96, 1)
    for q, top in ((quantize.int8_per_channel(w), 127), (quantize.fp8_per_channel(w), 448)):
        assert q.scale.shape == (96,) and torch.allclose(q.scale * top, w.abs().amax(1))
        step = q.scale[:, None] * (1 if q.kind == "int8" else 32)   # e4m3: 3 mantissa bits, step <= max / 16
        assert bool(((q.dequantize() - w).abs() <= step / 2 + 1e-7).all())
    q4 = quantize.int4_grouped(w)
    assert q4.group_size == 128 and q4.data.shape == (96, 128) and q4.scale.shape == (96, 2)
    assert bool(((q4.dequantize() - w).abs() <= q4.scale.repeat_interleave(128, 1) / 2 + 1e-6).all())
    assert quantize.int4_grouped(torch.randn(8, 576)).group_size == 64   # SmolLM2's hidden size
    values = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(values)), values)
    assert pack_int4(torch.tensor([[3, 12]])).item() == 3 | 12 << 4   # low nibble: the even column


@pytest.mark.parametrize("name", list(cpu_kernels.KERNELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernels_equal_the_dequantized_product(name, dtype):
    if name == "w8a8-amx" and not amx_linear.available():
        pytest.skip("no AMX tiles on this CPU")
    torch.manual_seed(0)
    w, x = torch.randn(192, 256) / 16, torch.randn(7, 256).to(dtype)
    activations = {"w8a8-amx": "int8", "w8a8-onednn": "int8", "w8a8-intmm": "int8", "fp8-scaledmm": "fp8",
                   "fp8-dequant": "fp8"}
    act = activations.get(name, "none")
    q = (quantize.int8_per_channel(w, act) if name.startswith("w8") else quantize.fp8_per_channel(w, act)
         if name.startswith("fp8") else quantize.int4_grouped(w))
    if act == "none":
        reference = x.float() @ q.dequantize().t()
    else:
        qx, row_scale = quantize.fake_quantize_rows(x, act)
        reference = (qx.float() * row_scale) @ q.dequantize().t()
    out = cpu_kernels.KERNELS[name](q)(x)
    assert out.dtype == dtype and out.shape == (7, 192)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), reference, atol=tol * reference.abs().max().item(), rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a16_widened_product_above_dequant_rows(dtype):
    """From DEQUANT_ROWS rows (and at float32, where aten's int8pack is not vectorised) W8A16 widens its weight and
    runs a dense product: the same result as the dequantized reference, on either side of the threshold."""
    torch.manual_seed(0)
    w = torch.randn(192, 256) / 16
    q = quantize.int8_per_channel(w, "none")
    kernel = cpu_kernels.Int8WeightOnly(q)
    for rows in (cpu_kernels.DEQUANT_ROWS - 1, cpu_kernels.DEQUANT_ROWS + 8):
        x = torch.randn(rows, 256).to(dtype)
        reference = x.float() @ q.dequantize().t()
        out = kernel(x)
        assert out.dtype == dtype and out.shape == (rows, 192)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out.float(), reference, atol=tol * reference.abs().max().item(), rtol=0)


def test_onednn_w8a8_runs_a_fast_int8_path_where_the_cpu_has_vnni(capfd):
    """Signed activations sent oneDNN's int8 matmul to its reference implementation on an AMD EPYC with
    AVX512-VNNI (640 ms for SmolLM2's 576 -> 1,536 product at 32 rows); unsigned ones with zero point 128 run its
    VNNI kernel, and the product stays exact."""
    if not {"avx512_vnni", "avx_vnni", "amx_int8"} & set(cpu_flags()):
        pytest.skip("no int8 dot-product instructions on this CPU")
    torch.manual_seed(0)
    q = quantize.int8_per_channel(torch.randn(64, 128), "int8")
    qx = torch.randint(-128, 128, (4, 128), dtype=torch.int8)
    kernel = cpu_kernels.Int8OneDNN(q)
    capfd.readouterr()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        out = kernel.product(qx, torch.float32)
    matmuls = [line.split(",") for line in capfd.readouterr().out.splitlines() if ",matmul," in line]
    if not matmuls:
        pytest.skip("oneDNN printed no verbose line for the product")
    assert not any(fields[fields.index("matmul") + 1].startswith("ref") for fields in matmuls), matmuls
    assert torch.equal(out, (qx.float() @ q.data.float().t()) * q.scale)
    assert cpu_kernels.onednn_int8_runs_fast()


def test_w8a8_leaves_onednn_for_int_mm_where_onednn_is_slow(monkeypatch):
    def reference_speed(self, qx, dtype):
        time.sleep(0.01)
        return torch.zeros(qx.shape[0], self.scale.numel(), dtype=dtype)

    def instant(self, qx, dtype):   # not the real _int_mm: its time on a loaded machine is not the test's
        return torch.zeros(qx.shape[0], self.scale.numel(), dtype=dtype)
    monkeypatch.setattr(cpu_kernels.Int8OneDNN, "product", reference_speed)
    monkeypatch.setattr(cpu_kernels.Int8IntMM, "product", instant)
    monkeypatch.setattr(amx_linear, "packable", lambda data: False)
    cpu_kernels.onednn_int8_runs_fast.cache_clear()
    threads = torch.get_num_threads()
    try:
        assert cpu_kernel_name(quantize.int8_per_channel(torch.randn(32, 64), "int8")) == "w8a8-intmm"
        assert torch.get_num_threads() == threads   # the probe times on one thread and gives the rest back
    finally:
        cpu_kernels.onednn_int8_runs_fast.cache_clear()


def test_int4_at_float32_compute_widens_its_nibbles():
    """aten's int4pack runs float32 rows on a scalar path (1,006 ms against 56 widened for a 0.3B layer's products
    at 32 rows): at float32 compute an int4 layer holds its nibbles and widens them; at 16 bits it stays packed."""
    q4 = quantize.int4_grouped(torch.randn(64, 256))
    assert cpu_kernel_name(q4, torch.float32) == "int4-widened"
    assert cpu_kernel_name(q4, torch.bfloat16) == cpu_kernel_name(q4) == "int4"


@pytest.mark.parametrize("name", ["w8a16", "int4-widened", "fp8-dequant"])
def test_a_widened_weight_too_large_for_one_temporary_is_widened_in_row_chunks(name, monkeypatch):
    """A layer whose float32 weight exceeds WIDEN_BYTES is widened and multiplied a chunk of output rows at a time
    (a 70B model's MLP projection would be a 1 GB temporary): the same product as in one piece."""
    torch.manual_seed(0)
    w, x = torch.randn(200, 256) / 16, torch.randn(40, 256)
    q = {"w8a16": lambda: quantize.int8_per_channel(w, "none"), "int4-widened": lambda: quantize.int4_grouped(w),
         "fp8-dequant": lambda: quantize.fp8_per_channel(w, "none")}[name]()
    kernel = cpu_kernels.KERNELS[name](q)
    whole = kernel(x)
    monkeypatch.setattr(cpu_kernels, "WIDEN_BYTES", 64 * 256 * 4)   # 64 rows a chunk: 4 chunks, the last short
    chunked = kernel(x)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(chunked, x @ q.dequantize().t(), atol=1e-4, rtol=0)


def test_cuda_dispatch_passes_the_canonical_weights_to_quant_gemm(monkeypatch):
    """The CUDA path's calls, run on CPU tensors against a stand-in for batchrun/kernels/quant_gemm.py that
    implements its documented interface (dequant = w * scale; int4: low nibble = even k, (q - zero) * scale)."""
    import sys
    import types

    from batchrun.quant import cuda_kernels

    def int8_linear(x, w, scale, bias):
        return (x.float() @ (w.float() * scale[:, None]).t()).to(x.dtype)

    def int4_linear(x, w, scales, zeros, group, bias):
        q = torch.stack([w & 15, w >> 4], dim=-1).reshape(w.shape[0], -1).float()
        deq = (q - zeros.repeat_interleave(group, 1)) * scales.repeat_interleave(group, 1)
        return (x.float() @ deq.t()).to(x.dtype)
    monkeypatch.setitem(sys.modules, "batchrun.kernels.quant_gemm",
                        types.SimpleNamespace(int8_linear=int8_linear, int4_linear=int4_linear))
    torch.manual_seed(0)
    w, x = torch.randn(64, 256) / 16, torch.randn(5, 256)
    for q, act in ((quantize.int8_per_channel(w), "none"), (quantize.int8_per_channel(w, "int8"), "int8"),
                   (quantize.int4_grouped(w), "none"), (quantize.fp8_per_channel(w), "fp8")):
        ref_x = x if act == "none" else quantized_input(x, act)
        tol = 1e-2 if q.kind == "fp8" else 2e-3   # _scaled_mm's row-wise scaling returns bfloat16
        torch.testing.assert_close(cuda_kernels.make(q)(x), ref_x @ q.dequantize().t(), atol=tol, rtol=tol)
    # a rotated W8A8 layer: the input rotated (the dense product, on the weight's device) before the kernel
    q, h = quantize.int8_per_channel(w, "int8", rotate_input=True), block_hadamard(256)
    layer = QuantizedLinear(torch.nn.Linear(1, 1), cuda_kernels.make(q), 64, "int8", q.nbytes, q.rotation)
    reference = quantized_input(x @ h, "int8") @ (q.dequantize() @ h).t()
    torch.testing.assert_close(layer(x, None), reference, atol=2e-3, rtol=2e-3)


# --- load-time quantization ---

@pytest.mark.parametrize("quantization,rotation,activations,rotated", [
    ("int8", "auto", "int8", True), ("int8", "none", "int8", False), ("int8-w8a16", "auto", None, True),
    ("fp8", "auto", "fp8", False), ("int4", "auto", None, False), ("int4", "hadamard", None, True)])
def test_load_time_quantized_greedy_equals_transformers_on_dequantized_weights(tiny_model, quantization, rotation,
                                                                               activations, rotated):
    """rotated: the reference quantizes W H and runs on its dequantized product with H (= W, quantized in the
    rotated basis), its W8A8 activations quantized as x H (quantkit)."""
    path, model = tiny_model
    llm, tokens = run(path, quantization=quantization, quantization_rotation=rotation)
    quantizer = {"int8": quantize.int8_per_channel, "int8-w8a16": quantize.int8_per_channel,
                 "fp8": quantize.fp8_per_channel, "int4": quantize.int4_grouped}[quantization]
    dequantized = {}
    for name, module in model.named_modules():
        if name.startswith("model.layers.") and isinstance(module, torch.nn.Linear):
            w = module.weight.detach()
            h = block_hadamard(w.shape[1]) if rotated else torch.eye(w.shape[1])
            dequantized[name] = quantizer(w @ h).dequantize() @ h
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, w in dequantized.items():
            reference.get_submodule(name).weight.copy_(w)
    if activations:
        quantize_activations(reference, activations, rotated=rotated)
    assert_greedy_matches(tokens, reference)
    layer = llm.engine.model.model.layers[0].mlp.gate_up_proj
    assert layer.quantized is not None and layer.weight.numel() == 0   # no float copy kept
    assert (layer.quantized.rotation is not None) == rotated
    assert ("Hadamard-rotated" in layer.quantized.description) == rotated


def test_whole_graph_runs_quantized_layers_through_the_opaque_op(tiny_model, monkeypatch):
    monkeypatch.setenv("BATCHRUN_COMPILE", "1")
    path, _ = tiny_model
    llm, tokens = run(path, quantization="int8")
    assert llm.engine.model._graph is not None
    monkeypatch.setenv("BATCHRUN_COMPILE", "ops")
    _, per_op = run(path, quantization="int8")
    assert tokens == per_op


# --- checkpoint formats ---

CHECKPOINTS = {
    "ct-fp8-w8a8-tensor": ("ct-fp8", dict(strategy="tensor", activations=True), "fp8"),
    "ct-fp8-w8a8-channel": ("ct-fp8", dict(strategy="channel", activations=True), "fp8"),
    "ct-fp8-w8a16-channel": ("ct-fp8", dict(strategy="channel"), None),
    "ct-int8-w8a8-channel": ("ct-int8", dict(strategy="channel", activations=True), "int8"),
    "ct-int8-w8a8-static": ("ct-int8", dict(strategy="tensor", activations=True, static=True), "int8"),
    "ct-int8-w8a16-packed": ("ct-int8", dict(strategy="channel", packed=True), None),
    "ct-int4-w4a16-group": ("ct-int4", dict(group=32), None),
    "awq-gemm": ("awq", dict(group=32), None),
    "gptq-sym": ("gptq", dict(group=32, sym=True), None),
    "gptq-asym-act-order": ("gptq", dict(group=32, sym=False, act_order=True), None),
}


@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_quantized_checkpoint_layers_and_greedy_equal_the_dequantized_reference(tmp_path, case):
    fmt, opts, activations = CHECKPOINTS[case]
    reference, dequantized, input_scales = write_quantized(tmp_path, fmt, **opts)
    llm, tokens = run(tmp_path)
    static = next(iter(input_scales.values()), None)
    for layer, w in hf_layers(llm, dequantized):
        x = torch.randn(5, w.shape[1])
        expected = (x if activations is None else quantized_input(x, activations, static)) @ w.t()
        torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-4)
    if activations:
        quantize_activations(reference, activations, input_scales)
    assert_greedy_matches(tokens, reference)


# --- the precision gate: weights x KV ---

@pytest.mark.slow   # 4 engines and a job: about 40 s on 2 shared cores
def test_kvcheck_compares_quantized_weights_and_the_gate_falls_back_to_float_weights(tmp_path, tiny_model):
    from click.testing import CliRunner

    from batchrun import Job
    from batchrun.cli import main
    from jobkit import write_job, write_prompts
    write_prompts(tmp_path / "in.parquet", 6)
    job = write_job(tmp_path, tiny_model[0], engine={"quantization": "int8"}, sampling={"max_tokens": 30,
                    "ignore_eos": True}, kv_quality_gate={"sample": 4, "min_identical": 1.0, "on_fail": "fallback"})
    result = CliRunner().invoke(main, ["kvcheck", job, "--sample", "3", "--quantization", "int4"])
    assert result.exit_code == 0, result.output
    assert "weights int4, kv auto vs auto:" in result.output and '"quantization": "int4"' in result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert report["mean_logprob"] < 0 and report["reference_mean_logprob"] < 0
    # W8A8 on the chaotic tiny model does not keep 4 of 4 outputs identical over 30 tokens: the gate falls back
    outcome = Job.from_yaml(job).run(progress="log")
    summary = json.load(open(f"{outcome.output_dir}/summary.json"))
    gate = summary["kv_quality_gate"]
    assert gate["action"] == "fallback" and gate["quantization"] == "none" and summary["quantization"] == "none"
    assert gate["report"]["quantization"] == "int8" and summary["rows_ok"] == 6


# --- refusals ---

def write_config(tmp_path, quantization_config: dict):
    """A model directory whose weights file is unreadable: a refusal must come before any weight is read."""
    save_tiny_model(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    return tmp_path


@pytest.mark.parametrize("config,message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
     "bitsandbytes .nf4 / int8.: the format is not supported"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "AWQ: version 'gemv'"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "GPTQ: 8-bit weights"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": False}}}},
     "compressed-tensors: weights int 8-bit channel asymmetric"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "block", "symmetric": True}}}},
     "compressed-tensors: weights float 8-bit block"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "kv_cache_scheme": {"num_bits": 8},
      "config_groups": {}}, "compressed-tensors: kv_cache_scheme"),
])
def test_unsupported_formats_are_refused_before_reading_weights(tmp_path, config, message):
    path = write_config(tmp_path, config)
    with pytest.raises(ValueError, match=f"quantization format {message}"):
        LLM(model=str(path), kv_cache_memory="4MiB")


def test_validate_names_the_refused_format_and_the_field(tmp_path):
    from batchrun import Job
    from batchrun.job.errors import JobError
    from jobkit import write_job, write_prompts
    model = write_config(tmp_path / "m", {"quant_method": "bitsandbytes", "load_in_4bit": True})
    write_prompts(tmp_path / "in.parquet", 2)
    refused = r"model \(line \d+\): quantization format bitsandbytes .nf4 / int8.: the format"
    with pytest.raises(JobError, match=refused):
        Job.from_yaml(write_job(tmp_path, str(model))).validate()
    plain = tmp_path / "plain"
    save_tiny_model(plain)
    ok = Job.from_yaml(write_job(tmp_path, str(plain), name="ok", engine={"quantization": "int4"})).validate()
    assert ok is not None
    awq = write_config(tmp_path / "awq", {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"})
    with pytest.raises(JobError, match=r"engine.quantization_rotation \(line \d+\): the checkpoint is already"):
        Job.from_yaml(write_job(tmp_path, str(awq), name="rot", engine={"quantization_rotation": "hadamard"})
                      ).validate()


def test_quantizing_a_quantized_checkpoint_and_unknown_values_are_refused(tmp_path):
    path = write_config(tmp_path, {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"})
    with pytest.raises(ValueError, match="already quantized .'awq'.*none or auto"):
        LLM(model=str(path), kv_cache_memory="4MiB", quantization="int8")
    with pytest.raises(ValueError, match="quantization: unknown value 'int3'"):
        LLM(model=str(path), quantization="int3")
    with pytest.raises(ValueError, match="quantization_rotation: the checkpoint is already quantized .'awq'.*or none"):
        LLM(model=str(path), kv_cache_memory="4MiB", quantization_rotation="hadamard")
    with pytest.raises(ValueError, match="quantization_rotation: unknown value 'random'"):
        LLM(model=str(path), quantization_rotation="random")
    moe = tiny_config("mixtral", num_local_experts=4)
    moe.quantization_config = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"}
    with pytest.raises(ValueError, match="quantized mixture-of-experts weights .mixtral."):
        scheme_for(moe)


def test_auto_picks_int8_w8a8_on_cpu():
    assert scheme_for(tiny_config(), "auto", "cpu").description.startswith("int8 W8A8")
    assert scheme_for(tiny_config(), "none", "cpu") is None
