"""Interactive-lane time to first token while a batch runs: the batch fills the engine, then a client thread
submits interactive requests at a fixed interval (open loop) while the main thread steps the engine, as a job
with `--serve` does. TTFT is measured by the client: from submit() to the first token it can read."""
from __future__ import annotations

import statistics
import threading
import time

from batchrun.gpucheck.engine_run import free_device
from batchrun.gpucheck.workload import max_len_for


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def _client(llm, prompts, params, interval_s, ttft, batch_left, errors):
    try:
        _submit_all(llm, prompts, params, interval_s, ttft, batch_left, errors)
    except Exception as exc:   # reported, not raised: the main thread must stop stepping
        errors.append(f"{type(exc).__name__}: {exc}")


def _submit_all(llm, prompts, params, interval_s, ttft, batch_left, errors):
    waiters, start = [], time.perf_counter()
    for i, prompt in enumerate(prompts):
        time.sleep(max(0.0, start + i * interval_s - time.perf_counter()))
        submitted = time.perf_counter()
        running = batch_left()
        handle = llm.submit(prompt, params, lane="interactive")

        def first_token(handle=handle, submitted=submitted, running=running):
            try:
                for chunk in handle.stream(timeout=120):
                    if chunk.new_token_ids:
                        ttft.append((time.perf_counter() - submitted, running))
                        break
                final = handle.result(timeout=120)
                if final.finish_reason in ("error", "abort"):
                    errors.append(f"{final.finish_reason}: {final.error}")
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
        waiters.append(threading.Thread(target=first_token, daemon=True))
        waiters[-1].start()
    for w in waiters:
        w.join()


def interactive_ttft(model: str, device: str, batch_prompts: list[list[int]], interactive_prompts: list[list[int]],
                     interval_s: float, max_tokens: int, batch_max_tokens: int, max_num_batched_tokens: int,
                     **options) -> dict:
    """batch_max_tokens: long enough that the batch outlasts the client (it is aborted then)."""
    from batchrun import LLM, SamplingParams
    max_model_len = max_len_for(batch_prompts + interactive_prompts, max(batch_max_tokens, max_tokens))
    llm = LLM(model=model, device=device, interactive_lane=True, max_model_len=max_model_len,
              max_num_seqs=len(batch_prompts), max_num_batched_tokens=max_num_batched_tokens, **options)
    llm.generate([p[::-1] for p in batch_prompts[:2]], SamplingParams(max_tokens=2, temperature=0),
                 use_tqdm=False)   # compile the kernels before timing
    long = SamplingParams(max_tokens=batch_max_tokens, temperature=0, ignore_eos=True)
    batch = {llm.add_request(p, long, lane="batch").request_id for p in batch_prompts}
    decoding: set[str] = set()
    while decoding != batch:   # until every batch request has its first token
        decoding.update(out.request_id for out in llm.step())
    ttft, errors = [], []
    client = threading.Thread(target=_client, daemon=True, args=(
        llm, interactive_prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), interval_s,
        ttft, lambda: len(batch), errors))
    batch_tokens, start = 0, time.perf_counter()
    client.start()
    while client.is_alive():
        for out in llm.step():
            if out.request_id in batch:
                batch_tokens += 1
                if out.finished:
                    batch.discard(out.request_id)
    wall = time.perf_counter() - start
    for request_id in list(batch):
        llm.engine.abort(request_id)
    del llm
    free_device(device)
    if errors or len(ttft) != len(interactive_prompts):
        raise RuntimeError(f"{len(interactive_prompts) - len(ttft)} of {len(interactive_prompts)} interactive "
                           f"requests got no token; first error: {errors[0] if errors else None}")
    seconds = [t for t, _ in ttft]
    return {"model": model, "batch_requests": len(batch_prompts), "interactive_requests": len(interactive_prompts),
            "interval_s": interval_s, "interactive_max_tokens": max_tokens,
            "min_batch_running_at_submit": min(r for _, r in ttft),
            "ttft_p50_s": round(statistics.median(seconds), 4), "ttft_p95_s": round(percentile(seconds, 95), 4),
            "ttft_max_s": round(max(seconds), 4), "window_s": round(wall, 3),
            "batch_tok_s_in_window": round(batch_tokens / wall, 1)}
