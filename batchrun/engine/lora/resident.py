"""The engine's adapters: every configured file checked against the model at start-up (before any work), at most
`max_adapters` loaded at a time (least recently used evicted), and each step's rows turned into its grouped
update (grouped.py)."""
from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from batchrun.engine.lora import grouped, projection, targets
from batchrun.engine.lora.adapter_file import AdapterFile
from batchrun.kernels import lora_expand

log = logging.getLogger("batchrun")
EXPAND_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class AdapterSet:
    def __init__(self, paths: dict[str, str], model: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                 max_adapters: int):
        self.files = {name: AdapterFile(name, path) for name, path in paths.items()}
        self.targets = {name: targets.resolve(model, file) for name, file in self.files.items()}
        wanted = {t.projection for per_module in self.targets.values() for t in per_module.values()}
        self.shapes = {p: (model.get_submodule(p).in_features, model.get_submodule(p).out_features) for p in wanted}
        self.projections = projection.wrap(model, wanted)
        self.dtype, self.device, self.max_adapters = dtype, device, max_adapters
        self.segmented = device.type == "cuda"   # the SGMV kernels; else the CPU's stacked or per-adapter products
        # the CPU's stacked expand through the C++ kernel (else oneDNN's masked products over every adapter's B)
        self.expand_kernel = device.type == "cpu" and dtype in EXPAND_DTYPES and lora_expand.load() is not None
        self.resident: OrderedDict[str, dict] = OrderedDict()   # least recently used first
        self.stacks: dict[str, grouped.Stack] | None = None     # over the resident set; None: to be rebuilt
        self.stack_order: dict[str, int] = {}                    # adapter -> its position in the stacks
        self.loads = 0   # adapters read from disk so far (LRU evictions show here)
        self.macs = {name: self.adapter_bytes(name) // self.element_size for name in self.files}   # per row

    def __contains__(self, name: str) -> bool:
        return name in self.files

    @property
    def fingerprints(self) -> dict[str, str]:
        return {name: file.fingerprint for name, file in self.files.items()}

    @property
    def element_size(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

    def adapter_bytes(self, name: str) -> int:
        """Size of one adapter (stacked A, block-diagonal B) in the model's dtype."""
        ranks: dict[str, int] = {}
        for module, target in self.targets[name].items():
            ranks[target.projection] = ranks.get(target.projection, 0) + self.files[name].modules[module].rank
        return self.element_size * sum(rank * sum(self.shapes[p]) for p, rank in ranks.items())

    def held_bytes(self, name: str) -> int:
        """What one resident adapter takes, all its copies: on CUDA its matrices are views into the stacks (one
        copy, B block-diagonal); on the CPU its own matrices, plus A again in the projections' fused weights, plus
        B's nonzero blocks for the expand kernel (or, without the kernel, B stacked twice: dense and packed)."""
        if self.segmented:
            return self.adapter_bytes(name)
        modules = self.files[name].modules
        a = sum(modules[m].rank * self.shapes[t.projection][0] for m, t in self.targets[name].items())
        b_nonzero = sum(modules[m].rank * (t.rows.stop - t.rows.start) for m, t in self.targets[name].items())
        extra = a + b_nonzero if self.expand_kernel else self.adapter_bytes(name) // self.element_size * 2 - a
        return self.adapter_bytes(name) + self.element_size * extra

    @property
    def reserved_bytes(self) -> int:
        """Memory the resident set can take: max_adapters of the largest adapter, as held (held_bytes)."""
        return min(self.max_adapters, len(self.files)) * max(self.held_bytes(name) for name in self.files)

    def weights(self, name: str, keep: set[str]) -> dict:
        """The adapter's stacked weights, loaded if not resident; evicts the least recently used beyond
        max_adapters, never one in `keep` (the step's)."""
        if name in self.resident:
            self.resident.move_to_end(name)
            return self.resident[name]
        for old in [n for n in self.resident if n not in keep][:max(0, len(self.resident) + 1 - self.max_adapters)]:
            del self.resident[old]
        self.stacks = None
        self.resident[name] = targets.stack(self.files[name], self.targets[name], self.shapes, self.dtype,
                                            self.device)
        self.loads += 1
        log.info("adapter %s loaded (%.1f MiB; %d resident)", name, self.adapter_bytes(name) / 2**20,
                 len(self.resident))
        return self.resident[name]

    def update(self, row_adapters: list[str | None]):
        """The step's grouped update for rows with these adapters (None: base), or None where no row has one."""
        runs, owners = self.runs(row_adapters)
        if not runs:
            return None
        if not self.segmented:
            stack_macs = sum(self.macs[name] for name in self.resident)
            if not grouped.stacked_wins(len(row_adapters), runs, [self.macs[name] for name in owners], stack_macs,
                                        len(self.shapes), self.dtype):
                return grouped.PerAdapter(runs)
        if self.stacks is None:   # positions fixed at the build: later uses reorder `resident` (the LRU)
            self.stacks = grouped.build_stacks(self.resident, self.shapes, pack=not self.segmented,
                                               kernel=self.expand_kernel and not self.segmented)
            self.stack_order = {name: i for i, name in enumerate(self.resident)}
            self.share_stacks() if self.segmented else self.fuse_shrinks()
        if self.segmented:
            return grouped.Segments(self.stacks, [(name, start, end) for name, (_, start, end) in zip(owners, runs)],
                                    self.device)
        row_owner = torch.tensor([self.stack_order.get(name, -1) for name in row_adapters], device=self.device)
        return grouped.Stacked(self.stacks, row_owner, torch.tensor(
            [(start, end, self.stack_order[name]) for name, (_, start, end) in zip(owners, runs)]))

    def share_stacks(self) -> None:
        """Each resident adapter's matrices become views into the stacks (the copy the SGMV kernels read): one
        copy held. A rebuild concatenates the views into new stacks, and the old ones go."""
        for name, weights in self.resident.items():
            for proj, w in weights.items():
                first, rank = self.stacks[proj].columns[name]
                weights[proj] = w._replace(a=self.stacks[proj].a[first:first + rank],
                                           b=self.stacks[proj].b[:, first:first + rank])

    def fuse_shrinks(self) -> None:
        """Each projection's stacked A packed under its base weight (projection.py); the stack's own A is then
        dropped. A projection no resident adapter adapts gets its plain base weight back."""
        for name, module in self.projections.items():
            stack = self.stacks.get(name)
            if stack is not None and module.fuse(stack.a):
                stack.a = None
            elif stack is None and module.fused is not None:
                module.fuse(None)

    def runs(self, row_adapters: list[str | None]) -> tuple[list[grouped.Run], list[str]]:
        """(weights, start, end) for each run of consecutive rows with the same adapter (base rows: none), and
        each run's adapter."""
        keep = set(row_adapters) - {None}
        runs, owners, start = [], [], 0
        for i in range(1, len(row_adapters) + 1):
            if i == len(row_adapters) or row_adapters[i] != row_adapters[start]:
                if row_adapters[start] is not None:
                    runs.append((self.weights(row_adapters[start], keep), start, i))
                    owners.append(row_adapters[start])
                start = i
        return runs, owners
