"""Peak resident memory while the engine loads a model's weights (read, fuse q/k/v and gate/up, assign), against
the weights' own size. Each measurement runs in a fresh process.

    python bench/load_memory.py [--model smollm2-135m] [--dtype float32]

The segment measured is Engine.__init__'s load: loader.load_weights(...) then model.load_state_dict(..., assign=True);
the CPU packing that follows (a second copy on CPU, see models/cpu_gemm.py) is not part of it.
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    out = subprocess.run([sys.executable, "-c", CHILD, args.model, args.dtype], capture_output=True, text=True)
    if out.returncode:
        sys.exit(out.stderr)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"CPU {r['cpu']}; {r['model']} {r['dtype']}: weights {r['weights_bytes'] / 2**20:.0f} MiB, peak RSS growth "
          f"during load {(r['rss_peak'] - r['rss_before']) / 2**20:.0f} MiB = {r['peak_over_weights']:.2f}x the weights")


if __name__ == "__main__":
    main()
