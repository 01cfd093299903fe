"""Resident memory of a model's weights against their own size, each measurement in a fresh process:

    python bench/load_memory.py [--model smollm2-135m] [--dtype float32]

- load: Engine.__init__'s load alone, loader.load_weights(...) then model.load_state_dict(..., assign=True);
- LLM: the whole LLM(...) (load, oneDNN packing on CPU, KV pool of 64 MiB, kernels), its peak and what stays
  resident after it returns, both less the KV pool, over the weights' size. Packing keeps one copy of each
  projection (models/cpu_gemm.py), so this stays near 1x plus a tied lm_head's packed copy.
"""
import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys, torch
from batchrun.cpuinfo import cpu_model
from batchrun.engine import loader
from batchrun.models.llama import LlamaForCausalLM
from batchrun.engine.backends import get_backend
model, dtype = sys.argv[1], getattr(torch, sys.argv[2])
path = loader.resolve_model_path(model)
config = loader.load_config(path)
with torch.device("meta"):
    net = LlamaForCausalLM(config, get_backend("auto", torch.device("cpu")))
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
before = rss()
weights = loader.load_weights(path, torch.device("cpu"), dtype, net.checkpoint_plan)
net.load_state_dict(weights, assign=True)
peak = rss()
size = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in net.state_dict().values()}.values())
print(json.dumps(dict(cpu=cpu_model(), model=model, dtype=sys.argv[2], weights_bytes=size, rss_before=before,
                      rss_peak=peak, peak_over_weights=round((peak - before) / size, 3))))
"""


LLM_CHILD = r"""
import json, resource, sys, torch
from batchrun import LLM
from batchrun.cpuinfo import cpu_model
from batchrun.engine import loader
model, dtype = sys.argv[1], sys.argv[2]
path = loader.resolve_model_path(model)
current = lambda: int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
before = current()
llm = LLM(model=path, dtype=dtype, kv_cache_memory="64MiB", max_model_len=1024)
peak, steady = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, current()
kv = llm.engine.num_blocks * llm.engine.config.block_size * llm.engine.kv_bytes_per_token
import glob, math, os
entries = {}
for file in glob.glob(os.path.join(path, "*.safetensors")):
    with open(file, "rb") as f:
        entries.update(loader.SafetensorsReader(f).entries)
sources = {src for srcs in llm.engine.model.checkpoint_plan(list(entries)).values() for src in srcs}   # tied: once
size = sum(math.prod(entries[src]["shape"]) for src in sources) * getattr(torch, dtype).itemsize
print(json.dumps(dict(cpu=cpu_model(), model=model, dtype=dtype, weights_bytes=size, kv_bytes=kv,
                      peak_over_weights=round((peak - before - kv) / size, 3),
                      steady_over_weights=round((steady - before - kv) / size, 3))))
"""


def run(child: str, model: str, dtype: str) -> dict:
    out = subprocess.run([sys.executable, "-c", child, model, dtype], capture_output=True, text=True)
    if out.returncode:
        sys.exit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    r = run(CHILD, args.model, args.dtype)
    print(f"CPU {r['cpu']}; {r['model']} {r['dtype']}: weights {r['weights_bytes'] / 2**20:.0f} MiB, peak RSS growth "
          f"during load {(r['rss_peak'] - r['rss_before']) / 2**20:.0f} MiB = {r['peak_over_weights']:.2f}x the weights")
    r = run(LLM_CHILD, args.model, args.dtype)
    print(f"LLM(...), less its {r['kv_bytes'] / 2**20:.0f} MiB KV pool: peak {r['peak_over_weights']:.2f}x the "
          f"weights, resident after {r['steady_over_weights']:.2f}x")


if __name__ == "__main__":
    main()
