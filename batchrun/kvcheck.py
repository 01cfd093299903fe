"""Precision quality gate: the same prompts, greedy, on the unquantized model (16-bit weights and KV) and with
quantized weights (engine.quantization) and/or an 8-bit KV dtype, compared token for token and by the chosen
tokens' logprobs.

Both sides run in deterministic mode (engine.deterministic), so a difference comes from the quantization alone, not
from which rows happened to share a step (at 16 bits that noise alone changed greedy outputs). Beside the share of
identical outputs the report gives a distribution figure: the mean change in log-likelihood of the reference's
tokens under the quantized run, over the positions where both runs have the same context (before the first
differing token); 0 for identical outputs, negative where quantization makes the reference's tokens less likely.
And a teacher-forced figure that no early divergence cuts short: each side's mean log-likelihood per token of the
sample prompts themselves (SamplingParams.prompt_logprobs), and the mean |difference| position by position."""
from __future__ import annotations

import gc
from dataclasses import asdict, dataclass, replace

from batchrun.engine.request import RequestOutput
from batchrun.sampling_params import SamplingParams


@dataclass
class KVCheckReport:
    kv_cache_dtype: str
    reference_dtype: str              # "auto": the compute dtype (float32 on CPU, 16-bit on CUDA)
    requests: int
    identical_fraction: float         # requests whose greedy outputs are token-for-token identical
    mean_first_diff: float | None     # mean position of the first differing token, over differing requests
    mean_abs_logprob_diff: float      # chosen-token logprobs, over positions before the first difference
    mean_delta_loglik: float          # candidate - reference logprob of the reference's token, same positions
    quantization: str = "none"        # the candidate's weights (engine.quantization; the reference's: none)
    mean_logprob: float | None = None            # candidate's chosen tokens, per token (its own outputs)
    reference_mean_logprob: float | None = None  # the reference's, per token
    prompt_loglik: float | None = None           # candidate's log-likelihood of the sample prompts, per token
    reference_prompt_loglik: float | None = None
    mean_abs_prompt_logprob_diff: float | None = None   # the two, position by position

    @property
    def loglik_drop(self) -> float | None:
        """How much less likely, per token, the quantized run finds the prompts (nats; negative: more likely)."""
        if self.prompt_loglik is None or self.reference_prompt_loglik is None:
            return None
        return self.reference_prompt_loglik - self.prompt_loglik

    def as_dict(self) -> dict:
        return {**asdict(self), "loglik_drop": self.loglik_drop}

    def summary(self) -> str:
        first = "n/a" if self.mean_first_diff is None else f"{self.mean_first_diff:.1f}"
        weights = "" if self.quantization == "none" else f"weights {self.quantization}, "
        return (f"{weights}kv {self.kv_cache_dtype} vs {self.reference_dtype}: {self.identical_fraction:.1%} of "
                f"{self.requests} greedy outputs identical, first difference at token {first} on average, "
                f"mean |d logprob| {self.mean_abs_logprob_diff:.4f}, d log-likelihood of the reference tokens "
                f"{self.mean_delta_loglik:+.4f} per token" + self._prompt_summary())

    def _prompt_summary(self) -> str:
        if self.loglik_drop is None:
            return ""
        return (f"; prompts, teacher-forced: log-likelihood {self.prompt_loglik:.4f} vs "
                f"{self.reference_prompt_loglik:.4f} per token (drop {self.loglik_drop:+.4f}), mean |d logprob| "
                f"{self.mean_abs_prompt_logprob_diff:.4f}")


def compare(reference: list[RequestOutput], candidate: list[RequestOutput], kv_cache_dtype: str,
            reference_dtype: str = "auto", quantization: str = "none") -> KVCheckReport:
    firsts, deltas = [], []
    for ref, out in zip(reference, candidate):
        common = next((i for i, (a, b) in enumerate(zip(ref.token_ids, out.token_ids)) if a != b),
                      None if len(ref.token_ids) == len(out.token_ids) else min(len(ref.token_ids),
                                                                                  len(out.token_ids)))
        if common is not None:
            firsts.append(common)
        same = len(ref.token_ids) if common is None else common
        deltas += [b - a for a, b in zip(ref.logprobs[:same], out.logprobs[:same])]
    n, count = len(reference), max(len(deltas), 1)
    prompt_diffs = [abs(b - a) for ref, out in zip(reference, candidate)
                    for a, b in zip(_scored(ref), _scored(out))]
    return KVCheckReport(kv_cache_dtype, reference_dtype, n, (n - len(firsts)) / n if n else 1.0,
                         sum(firsts) / len(firsts) if firsts else None, sum(map(abs, deltas)) / count,
                         sum(deltas) / count, quantization, _mean_logprob(candidate), _mean_logprob(reference),
                         _mean(v for out in candidate for v in _scored(out)),
                         _mean(v for out in reference for v in _scored(out)), _mean(prompt_diffs))


def _scored(out: RequestOutput) -> list[float]:
    return [v for v in (out.prompt_logprobs or []) if v is not None]


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def _mean_logprob(outputs: list[RequestOutput]) -> float | None:
    return _mean(v for out in outputs for v in (out.logprobs or []))


def run_kvcheck(make_llm, prompts: list, params: list[SamplingParams], kv_cache_dtype: str,
                reference_dtype: str = "auto", quantization: str = "none") -> KVCheckReport:
    """`make_llm(kv_cache_dtype, quantization)` builds an LLM (in deterministic mode, see the module's doc); prompts run greedy with logprobs on the reference
    (reference_dtype KV, float weights) and the candidate, one engine at a time (so both need not fit in memory
    together)."""
    greedy = [replace(p, temperature=0.0, logprobs=True, prompt_logprobs=True) for p in params]
    outputs = []
    for dtype, weights in ((reference_dtype, "none"), (kv_cache_dtype, quantization)):
        llm = make_llm(dtype, weights)
        outputs.append(llm.generate(prompts, greedy, use_tqdm=False))
        del llm
        gc.collect()
    return compare(outputs[0], outputs[1], kv_cache_dtype, reference_dtype, quantization)
