"""Interactive latency while a batch job saturates the engine: lanes vs one FIFO pool vs an idle engine.

    python bench/interactive_latency.py [--rows 64] [--rate 0.5] [--requests 12] [--json out.json]

In this process: one LLM, the HTTP server in a thread (as `batchrun submit --serve`), and a job-like loop in the
main thread that keeps the engine full of batch requests (the sample prompts, cycled, chat template) and steps it
with `llm.step()`. A separate client process (this script with --client) sends streaming chat requests through
the official openai client at a fixed rate (open loop: one request every 1/rate s, whatever the previous ones do)
and reports time to first token (TTFT) and time per output token after the first (TPOT).

Scenarios, in one run:
  idle    no batch work; lanes off
  lanes   batch job + interactive requests on the interactive lane (LLM(interactive_lane=True))
  capped  lanes, and the batch lane limited to --batch-tokens-while-interactive tokens per step while interactive
          requests run (LLM(batch_tokens_while_interactive=N))
  fifo    batch job + the same requests sent with lane="batch": one shared pool, first come first served
Batch throughput is batch output tokens/s over a window of the same length with and without the client.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

QUESTIONS = ["What is the capital of France?", "Give me three tips for sleeping well.",
             "Explain what a hash table is in two sentences.", "Write a haiku about autumn.",
             "How do I boil an egg?", "Name three planets and one fact about each."]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))], 4)


# ---------------------------------------------------------------------------------------------- client process
def client_main(args) -> None:
    import openai
    client = openai.OpenAI(base_url=args.client + "/v1", api_key="bench", max_retries=0, timeout=600)
    results: list[dict] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        start = time.perf_counter()
        first = last = None
        tokens, error = 0, None
        try:
            stream = client.chat.completions.create(
                model="bench", messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                max_tokens=args.max_tokens, temperature=0, stream=True, stream_options={"include_usage": True})
            for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
                    first = first or now
                    last = now
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
        except Exception as exc:   # counted, not fatal: an overloaded server is a result too
            error = f"{type(exc).__name__}: {exc}"
        with lock:
            results.append({"ttft": None if first is None else first - start,
                            "tpot": (last - first) / (tokens - 1) if first and tokens > 1 else None,
                            "tokens": tokens, "error": error})

    print("ready", flush=True)        # imports done: the server starts its measurement window now
    threads, t0 = [], time.perf_counter()
    for i in range(args.requests):
        time.sleep(max(0.0, t0 + i / args.rate - time.perf_counter()))
        threads.append(threading.Thread(target=one, args=(i,)))
        threads[-1].start()
    for t in threads:
        t.join()
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    print(json.dumps({"requests": len(results), "errors": sum(r["error"] is not None for r in results),
                      "first_error": next((r["error"] for r in results if r["error"]), None),
                      "ttft_p50_s": pct(ttft, 50), "ttft_p95_s": pct(ttft, 95),
                      "tpot_p50_s": pct(tpot, 50), "tpot_p95_s": pct(tpot, 95),
                      "mean_tokens": round(statistics.mean(r["tokens"] for r in results), 1) if results else 0,
                      "client_wall_s": round(time.perf_counter() - t0, 2)}))


# ---------------------------------------------------------------------------------------------- server process
class BatchFeed:
    """The job's side: keeps max_num_seqs + a waiting queue of batch requests in the engine (as the job runner)."""

    def __init__(self, llm, prompts: list[list[int]], max_tokens: list[int], cap: int):
        from batchrun import SamplingParams
        self.llm, self.prompts, self.cap = llm, prompts, cap
        self.params = [SamplingParams(max_tokens=m, temperature=0) for m in max_tokens]
        self.next, self.in_flight, self.ids = 0, set(), 0

    def top_up(self) -> None:
        while len(self.in_flight) < self.cap:
            i = self.next % len(self.prompts)
            self.next += 1
            self.ids += 1
            rid = f"batch-{self.ids}"
            self.llm.add_request(self.prompts[i], self.params[i], request_id=rid, lane="batch")
            self.in_flight.add(rid)

    def step(self) -> int:
        """One engine step; returns the batch tokens it produced."""
        outs = self.llm.step()
        for out in outs:
            if out.finished:
                self.in_flight.discard(out.request_id)
        return sum(1 for o in outs if o.finish_reason not in ("error", "abort"))


def run_window(llm, feed: BatchFeed | None, client_cmd: list[str] | None, seconds: float | None) -> dict:
    """Step the engine until the client exits (or for `seconds`); batch tokens/s over the window."""
    lines: list[str] = []
    proc = reader = None
    if client_cmd:
        proc = subprocess.Popen(client_cmd, stdout=subprocess.PIPE, text=True)
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
    tokens, start = 0, None if proc else time.perf_counter()
    while True:
        if proc is not None and proc.poll() is not None:
            break
        if start is None and lines:          # the client has started: measure from here
            start = time.perf_counter()
        if proc is None and time.perf_counter() - start >= seconds:
            break
        if feed is not None:
            feed.top_up()
        if llm.has_unfinished():
            n = feed.step() if feed is not None else len(llm.step())
            tokens += n if start is not None else 0
        else:
            time.sleep(0.002)
    wall = time.perf_counter() - (start or time.perf_counter())
    result = {"window_s": round(wall, 2)}
    if feed is not None:
        result["batch_tok_s"] = round(tokens / wall, 2)
    if proc is not None:
        reader.join(5)
        out = [line for line in lines if line.startswith("{")]
        result.update(json.loads(out[-1]) if out else {"client_error": f"exit code {proc.returncode}"})
    return result


def make_llm(args, lanes: bool, capped: bool):
    from batchrun import LLM
    options = dict(kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens)
    if args.max_model_len:
        options["max_model_len"] = args.max_model_len
    if lanes:
        options.update(interactive_lane=True, interactive_kv_memory=args.interactive_kv_memory)
    if capped:
        options["batch_tokens_while_interactive"] = args.batch_tokens_while_interactive
    return LLM(model=args.model, **options)


def scenario(args, lanes: bool, capped: bool, lane: str, with_batch: bool, rows: list[dict]) -> dict:
    from batchrun.server import ServerThread, create_app
    llm = make_llm(args, lanes, capped)
    llm.max_pending_submits = 4 * args.requests
    server = ServerThread(create_app(llm, model_name="bench", lane=lane)).start()
    feed = None
    if with_batch:    # the sample job: each prompt as a user message, its own max_tokens
        prompts = [llm.encode([{"role": "user", "content": r["prompt"]}]) for r in rows]
        feed = BatchFeed(llm, prompts, [int(r.get("max_tokens") or 64) for r in rows], 2 * args.max_num_seqs)
    client = [sys.executable, os.path.abspath(__file__), "--client", server.url, "--rate", str(args.rate),
              "--requests", str(args.requests), "--max-tokens", str(args.max_tokens)]
    try:
        run_window(llm, None, client[:4] + ["--requests", "1", "--rate", "1", "--max-tokens", "2"], None)  # warm-up
        if feed is not None:
            run_window(llm, feed, None, args.warmup_s)              # fill the engine first
        loaded = run_window(llm, feed, client, None)
        result = {"interactive": loaded}
        if feed is not None:
            result["batch_alone"] = run_window(llm, feed, None, max(loaded["window_s"], 1.0))
        result["preemptions"] = llm.engine.stats.preemptions
        return result
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--client", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default=os.path.join(os.path.dirname(__file__), "..", "sample_data", "prompts.parquet"))
    ap.add_argument("--rows", type=int, default=64, help="batch prompts (cycled while the client runs)")
    ap.add_argument("--rate", type=float, default=0.5, help="interactive requests per second")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=32, help="interactive max_tokens")
    ap.add_argument("--warmup-s", type=float, default=5.0, help="batch-only seconds before measuring")
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--interactive-kv-memory", default="512MiB",
                    help="the interactive lane's pool (float32 on CPU); it must hold one request at max context")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--batch-tokens-while-interactive", type=int, default=16,
                    help="the batch lane's per-step token cap while interactive requests run (scenario 'capped')")
    ap.add_argument("--scenarios", default="idle,lanes,capped,fifo")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.client:
        return client_main(args)

    import pyarrow.parquet as pq
    rows = pq.read_table(args.data).slice(0, args.rows).to_pylist()
    results = {"config": {k: v for k, v in vars(args).items() if k not in ("client", "json")}}
    for name in args.scenarios.split(","):
        lanes, capped, lane, with_batch = {"idle": (False, False, "interactive", False),
                                           "lanes": (True, False, "interactive", True),
                                           "capped": (True, True, "interactive", True),
                                           "fifo": (False, False, "batch", True)}[name]
        t = time.perf_counter()
        results[name] = scenario(args, lanes, capped, lane, with_batch, rows)
        print(f"{name}: {json.dumps(results[name])} ({time.perf_counter() - t:.0f}s)", file=sys.stderr, flush=True)
    summary = {}
    idle = results.get("idle", {}).get("interactive", {})
    for name in ("lanes", "capped", "fifo"):
        if name in results:
            r = results[name]
            summary[name] = {"ttft_p95_vs_idle": (round(r["interactive"]["ttft_p95_s"] / idle["ttft_p95_s"], 2)
                                                  if idle.get("ttft_p95_s") and r["interactive"].get("ttft_p95_s")
                                                  else None),
                             "batch_throughput_loss": round(1 - r["interactive"]["batch_tok_s"]
                                                            / max(r["batch_alone"]["batch_tok_s"], 1e-9), 3)}
    results["summary"] = summary
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
