"""The notebook path: the quickstart executed top to bottom on a real Jupyter kernel, results as DataFrames with
the input joined back, a kernel interrupt during Job.run() that keeps the work, and an LLM left usable after one."""
import importlib.util
import json
import time
from pathlib import Path

import nbformat
import pyarrow.parquet as pq
import pytest
from jupyter_client.manager import start_new_kernel
from nbclient import NotebookClient

from batchrun import SamplingParams
from batchrun.job import Job
from conftest import random_prompts
from jobkit import write_job, write_prompts

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "quickstart.ipynb"


def output_text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            parts.append(out.get("text", "") + out.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


def test_quickstart_runs_top_to_bottom_on_a_kernel(tiny_model, monkeypatch):
    monkeypatch.setenv("BATCHRUN_QUICKSTART_MODEL", tiny_model[0])
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()   # raises on an error cell
    text = output_text(nb)
    assert not [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert "rows: 8 ok: 8" in text and "status='done'" in text
    assert "plan rows: 6" in text and "q7" in text and "Who wrote Hamlet?" in text


def run_cell(client, code: str, while_running=None, timeout: float = 300) -> str:
    """Execute code on the kernel; returns its stdout. while_running(): called until it returns True."""
    msg_id = client.execute(code)
    text, end = [], time.time() + timeout
    while time.time() < end:
        if while_running is not None and while_running():
            while_running = None
        try:
            msg = client.get_iopub_msg(timeout=0.2)
        except Exception:   # queue.Empty: nothing yet
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            text.append(content["text"])
        elif kind == "error":
            text.append(f"{content['ename']}: {content['evalue']}")
        elif kind == "status" and content["execution_state"] == "idle":
            return "".join(text)
    raise TimeoutError(f"the kernel did not finish {code!r} in {timeout} s")


def test_interrupting_the_kernel_during_a_job_keeps_the_work_and_the_cell_resumes(tmp_path, tiny_model):
    ids = write_prompts(tmp_path / "in.parquet", 300)
    job = write_job(tmp_path, tiny_model[0], sampling={"max_tokens": 24})
    data = tmp_path / "out" / "job" / "data"
    cell = (f"from batchrun import Job\nresult = Job.from_yaml({job!r}).run()\n"
            f"print('STATUS', result.status, result.summary['rows_remaining'])\nprint(repr(result))")
    manager, client = start_new_kernel(kernel_name="python3")
    try:
        interrupted = []

        def interrupt_after_two_shards() -> bool:
            if len(list(data.glob("*.parquet"))) >= 2 and not interrupted:
                manager.interrupt_kernel()
                interrupted.append(time.time())
            return bool(interrupted)

        first = run_cell(client, cell, interrupt_after_two_shards)
        assert interrupted and "STATUS interrupted" in first, first
        remaining = int(first.split("STATUS interrupted ")[1].split()[0])
        assert 0 < remaining < 300 and "run the job again (Job.run()) to resume" in first
        second = run_cell(client, cell)
        assert "STATUS done 0" in second, second
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    rows = pq.read_table(data).to_pylist()
    assert sorted(r["id"] for r in rows) == ids                     # every id exactly once
    summary = json.loads((tmp_path / "out" / "job" / "summary.json").read_text())
    assert summary["status"] == "done" and summary["rows_ok"] == 300


def test_results_join_the_input_back_in_input_order(tmp_path, tiny_model):
    ids = write_prompts(tmp_path / "in.parquet", 12, topic=[f"t{i}" for i in range(12)])
    result = Job.from_yaml(write_job(tmp_path, tiny_model[0])).run(progress="log")
    df = result.to_pandas(with_input=True)
    assert list(df["id"]) == ids and list(df["topic"]) == [f"t{i}" for i in range(12)]
    assert list(df["input_id"]) == ids and df["prompt"].str.len().min() > 0 and (df["status"] == "ok").all()


def test_to_pandas_without_pandas_names_the_extra(tmp_path, tiny_model, monkeypatch):
    write_prompts(tmp_path / "in.parquet", 2)
    result = Job.from_yaml(write_job(tmp_path, tiny_model[0])).run(progress="log")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pandas" else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install 'batchrun\[notebook\]'"):
        result.to_pandas()
    assert result.table().num_rows == 2


def test_an_interrupted_generate_leaves_the_llm_usable(tiny_llm, monkeypatch):
    prompts, params = random_prompts([5, 9, 14, 7]), SamplingParams(max_tokens=12, temperature=0)
    expected = [o.token_ids for o in tiny_llm.generate(prompts, params, use_tqdm=False)]
    real_step, calls = tiny_llm.step, []

    def step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(tiny_llm, "step", step)
    with pytest.raises(KeyboardInterrupt):
        tiny_llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    engine = tiny_llm.engine
    assert not engine.has_unfinished() and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert [o.token_ids for o in tiny_llm.generate(prompts, params, use_tqdm=False)] == expected
