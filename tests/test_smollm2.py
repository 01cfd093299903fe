"""The embedded SmolLM2 against transformers generate on sample_data prompts (slow: converts the GGUF once)."""
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from batchrun import LLM, SamplingParams

pytestmark = pytest.mark.slow
SAMPLE = Path(__file__).resolve().parents[1] / "sample_data" / "prompts.parquet"


@pytest.fixture(scope="module")
def smollm2():
    return LLM(model="smollm2-135m", kv_cache_memory="512MiB", max_num_batched_tokens=256)


def test_greedy_matches_transformers(smollm2):
    from transformers import AutoModelForCausalLM
    rows = pq.read_table(SAMPLE).slice(0, 12).to_pylist()
    prompts = [r["prompt"] for r in rows]
    outs = smollm2.generate(prompts, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
    reference = AutoModelForCausalLM.from_pretrained(smollm2.model_path, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        ids = smollm2.tokenizer(prompt).input_ids
        expected = reference.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        assert out.token_ids == expected, prompt[:80]


def test_chat_answer_is_sensible(smollm2):
    out = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0]
    assert "Paris" in out.text and out.finish_reason == "stop"


def test_extraction_job_every_finished_row_validates(tmp_path):
    import json
    import shutil

    import jsonschema

    from batchrun import Job
    root = Path(__file__).resolve().parents[1]
    jobs = tmp_path / "jobs"
    shutil.copytree(root / "jobs", jobs)
    shutil.copytree(root / "sample_data", tmp_path / "sample_data")
    schema = json.loads((jobs / "extract.schema.json").read_text())
    rows = Job.from_yaml(str(jobs / "extract.yaml")).run(progress="log").table().to_pylist()
    finished = [r for r in rows if r["finish_reason"] == "stop"]
    assert len(finished) >= 4, [(r["finish_reason"], r["text"]) for r in rows]
    for r in finished:
        assert r["status"] == "ok", r["error"]
        jsonschema.validate(json.loads(r["json"]), schema)
