"""The step-time model fitted on a machine's own measured steps (calibration, the job's ETA): t = a + b x tokens
+ c x private context + cs x shared context + d x prefill pairs + e x sequences + g x [prefill in the step], by least
squares with non-negative coefficients, outliers dropped, and priors (ContextPrior) where the steps cannot tell two
coefficients apart.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from batchrun.engine.step_stats import StepShape
from batchrun.stepmodel.costmodel import ModelSpec


@dataclass
class LinearModel:
    """t = a + b x tokens + c x private context + cs x shared context + d x prefill pairs + e x sequences
    + g x [a prefill chunk in the step]: fitted on measured steps of this machine (calibration, the job's ETA).

    - c, cs: the context (KV) each scheduled sequence reads, the tokens of blocks an earlier sequence of the step
      reads too (StepShape.shared_kv_tokens: a prefix cached once, read from memory once) at cs, the rest at c.

    - d: a prefill chunk's attention (its new tokens x their context, StepShape.prefill_pairs), which grows with the
      chunk's context as a decode step's does not: without it, c took that growth from the prefill steps and
      mispriced the decode steps (and the reverse).
    - e: what each sequence costs beyond its tokens (its row of the lm_head, its sampling). A decode token pays it, a
      prefill token does not: with tokens alone, a full batch's 32 x e went into a, and the small batches of a job's
      drain were priced 4-9 % high, the prefill steps 3-4 % low (SmolLM2, bf16 and fp32 on a Xeon).
    - g: a step with a prefill chunk runs the prefill attention path besides the decode one (its per-layer calls):
      a fixed cost of such steps, which a mixed step of a few new tokens otherwise lacked (priced 3-4 % low)."""
    a: float
    b: float
    c: float
    d: float = 0.0
    e: float = 0.0
    g: float = 0.0
    cs: float = 0.0
    train_error: float = 0.0       # mean absolute % error on the steps it was fitted on
    heldout_error: float = 0.0     # ... on held-out steps
    heldout_total_error: float = 0.0  # % error of the summed time of the held-out steps
    steps: int = 0
    outliers: int = 0              # training steps dropped as stalls before the final fit
    scale: float = 1.0             # measured / fitted time over every pilot step: the stalls put back in the level

    def step_time(self, s: StepShape) -> float:
        return self.scale * max(self.a + self.b * s.tokens + self.c * s.unique_kv_tokens
                                + self.cs * s.shared_kv_tokens + self.d * s.prefill_pairs + self.e * s.seqs
                                + self.g * (s.tokens > s.seqs), 0.0)

    def to_dict(self) -> dict:
        return {"a_s": self.a, "b_s_per_token": self.b, "c_s_per_private_context_token": self.c,
                "cs_s_per_shared_context_token": self.cs, "d_s_per_prefill_pair": self.d,
                "e_s_per_sequence": self.e, "g_s_per_prefill_step": self.g, "steps": self.steps,
                "outliers": self.outliers, "scale": round(self.scale, 4), "train_mape_pct": round(self.train_error, 2),
                "heldout_mape_pct": round(self.heldout_error, 2),
                "heldout_total_error_pct": round(self.heldout_total_error, 2)}


def _mape(pred: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.abs(pred - y) / np.maximum(y, 1e-9)) * 100)


A, B, C, D, E, G, CS = range(7)   # LinearModel's coefficients, in the order of fit_linear's columns


def step_features(shapes: list[StepShape]) -> np.ndarray:
    """fit_linear's columns: 1, tokens, private context, prefill pairs, sequences, a prefill chunk in the step (0/1),
    shared context."""
    return np.array([[1.0, s.tokens, s.unique_kv_tokens, s.prefill_pairs, s.seqs, float(s.tokens > s.seqs),
                      s.shared_kv_tokens] for s in shapes], dtype=float)


@dataclass(frozen=True)
class ContextPrior:
    """What the fit assumes where the steps cannot tell two coefficients apart.

    - c = ratio x a, to within `spread`. A decode step reads every weight once (a) and each context token's KV once
      (c); where both are bandwidth-bound their ratio is the ratio of the bytes, KV bytes per token / weight bytes,
      whatever the machine's bandwidth. While the KV pool is full, every step's context sum is about the same, and
      least squares alone puts the attention into a, which then overprices the short-context steps that follow. Steps
      whose contexts vary outweigh the prior. Where a holds much besides reading the weights (launch and scheduling
      overhead on a GPU), ratio x a overstates c.
    - e = sequence_ratio x b: a sequence's lm_head row against a token's layers (their FLOPs: vocab x hidden over
      the layers' parameters). While every decode step runs a full batch, a step's own cost and its sequences'
      cannot be told apart; the drain's small batches that follow are priced by this split.
    - d = pair_ratio x b, to within PAIR_SPREAD: a prefill pair's attention against a token's layers. A run's first
      steps are mostly decodes and a few short chunks, whose new tokens and prefill pairs grow together: a fit of 8
      such steps (float32, shortest first) put their time into d (4.2e-5 s a pair, b = 0) and priced the long
      prompts' chunks to come at 21 s each, the first estimate 4.9x the time left."""
    ratio: float               # (s per context token) / (s per step)
    spread: float = 0.25       # its relative standard deviation
    sequence_ratio: float = 0.0   # (s per sequence) / (s per token); 0: nothing known, e ~ 0 unless the steps say
    pair_ratio: float = 0.0       # (s per prefill pair) / (s per token); 0: nothing known, d free

    @classmethod
    def from_bytes(cls, kv_bytes_per_token: float, weight_bytes: float, sequence_ratio: float = 0.0,
                   pair_ratio: float = 0.0) -> "ContextPrior":
        return cls(kv_bytes_per_token / max(weight_bytes, 1.0), sequence_ratio=sequence_ratio, pair_ratio=pair_ratio)

    @classmethod
    def of_engine(cls, engine) -> "ContextPrior":
        """An engine's KV bytes per context token over the bytes of its weights (every expert counted: a decode step
        of a batch reads most of them), a sequence's lm_head row over a token's layers (sequence_ratio), and a prefill
        pair's attention over a token's layers at ATTENTION_SLOWDOWN x their FLOP rate (pair_ratio)."""
        spec = ModelSpec.from_config(engine.hf_config)
        return cls.from_bytes(engine.kv_bytes_per_token, spec.num_params * engine.dtype.itemsize,
                              spec.sequence_ratio, spec.pair_ratio * ATTENTION_SLOWDOWN)


SEQUENCE_SPREAD = 0.15   # the least deviation of e from its prior, in units of b
# Attention's FLOPs run slower than the projections': d / b over the FLOP ratio in fits of whole runs of SmolLM2 on
# a Xeon was 2.3 (float32) and 2.7 (bfloat16). The spread is wide: steps that tell d from b outweigh it.
ATTENTION_SLOWDOWN = 2.5
PAIR_SPREAD = 1.0
# A shared context token's price over a private one's (cs / c): fitted on whole runs of a 1,000-row job whose prompts
# each run beside their copies, shortest first (SmolLM2; bench/shared_kv_probe.py, the decode steps), 0.62 and 0.67
# at bf16 on an Intel Xeon, 0.75 (bf16) and 0.52 (fp32) on an AMD EPYC. A run's shared share grows with its context
# (7 % of the decode steps' context in the first tenth, 45 % at half the run), so the steps so far do not tell the two
# apart: free splits on the first half gave 0.58, 0.68, 1.32 (Xeon; the last priced the tail 1.27x) and 1.29 (AMD),
# the job's fit at 25-75 % of a run 0.18-0.85. Replayed on four 1,000-row runs (AMD, bf16 and fp32, both orders;
# bench/eta_fit_probe.py --replay), the rest of each run was priced within 4.9-5.1 % on average with the spread at
# 0.08-0.1 (the ratio 0.6-0.8 alike), 6.1 % at 0.3, 6.8 % at 1.0 and 6.4 % with one context term.
SHARED_RATIO = 0.7
SHARED_SPREAD = 0.1       # relative standard deviation


def _prior_rows(x: np.ndarray, y: np.ndarray, prior: ContextPrior | None) -> tuple[np.ndarray, np.ndarray]:
    """The priors as least-squares rows (x and y already weighted): Gaussian priors on c - ratio x a (deviation
    spread x ratio x a0), on e - sequence_ratio x b (deviation SEQUENCE_SPREAD x b0, at least), on
    d - pair_ratio x b (deviation PAIR_SPREAD x pair_ratio x b0) and on cs - SHARED_RATIO x c (deviation
    SHARED_SPREAD x SHARED_RATIO x c0), each weighed against the steps' noise sigma (row weight = sigma / deviation).
    a0, b0 and c0 come from the fit tied to the priors (c0 from the free fit without a prior), sigma from the free
    fit's residuals: where the steps fit the free model well, a wrong prior cannot pull it. Without a prior: e ~ 0
    (a sequence costs what a token does) unless the steps say otherwise, and d free."""
    ratio, per_sequence, pair = (prior.ratio, prior.sequence_ratio, prior.pair_ratio) if prior else (0.0, 0.0, 0.0)
    tied_x = np.c_[x[:, A] + ratio * (x[:, C] + SHARED_RATIO * x[:, CS]),
                   x[:, B] + per_sequence * x[:, E] + pair * x[:, D], x[:, D] * (pair == 0), x[:, G]]
    tied = _nonneg_lstsq(tied_x, y)
    free = _nonneg_lstsq(x, y)
    sigma = _robust_sigma(y - x @ free)
    rows = []

    def tie(base: int, tied_to: int, to_ratio: float, deviation: float) -> None:
        """A row for coefficient[tied_to] - to_ratio x coefficient[base] = 0, weighed sigma / deviation."""
        row = np.zeros(x.shape[1])
        w = sigma / deviation
        row[base], row[tied_to] = -w * to_ratio, w
        rows.append(row)

    if prior and tied[0] > 0:
        tie(A, C, prior.ratio, prior.spread * prior.ratio * tied[0])
    if (private := prior.ratio * tied[0] if prior else free[C]) > 0:   # steps with no shared context price it too
        tie(C, CS, SHARED_RATIO, SHARED_SPREAD * SHARED_RATIO * private)
    if tied[1] > 0 and x[:, E].any():
        tie(B, E, per_sequence, max(SEQUENCE_SPREAD, 0.5 * per_sequence) * tied[1])
    if pair and tied[1] > 0 and x[:, D].any():
        tie(B, D, pair, PAIR_SPREAD * pair * tied[1])
    return np.array(rows).reshape(-1, x.shape[1]), np.zeros(len(rows))


def fit_linear(shapes: list[StepShape], times: list[float], holdout_every: int = 5,
               prior: ContextPrior | None = None, weights=None) -> LinearModel:
    """Least squares with non-negative coefficients on all but every `holdout_every`-th step; those are held out to
    report the error (holdout_every=0: fit on every step, no held-out error). weights: each step's weight in the
    fit and in the robust spread that judges outliers (recent_fit weighs recent steps more); None: all equal."""
    need = max(2 * holdout_every, 3)
    if len(shapes) < need:
        raise ValueError(f"calibration: {len(shapes)} measured steps are too few to fit and check the step-time "
                         f"model (need at least {need}); run a longer pilot (--pilot-fraction)")
    x = step_features(shapes)
    y = np.array(times, dtype=float)
    w = np.ones(len(y)) if weights is None else np.asarray(weights, dtype=float)
    root = np.sqrt(w)[:, None]
    held = (np.arange(len(y)) % holdout_every == holdout_every - 1) if holdout_every else np.zeros(len(y), bool)
    train = ~held
    # steps of one token count only (so far, full prefill chunks): a and b cannot be told apart; the time goes to b
    if np.ptp(x[:, B]) == 0:
        x[:, A], prior = 0.0, None
    if np.ptp(x[train, G]) == 0 or not _sizes_vary(x[train & (x[:, G] > 0), B]):
        x[:, G] = 0.0   # all prefill steps or none (their fixed cost is a's), or all of one size (it is b's)
    for _ in range(3):   # a shared CPU stalls now and then: drop steps far off the fit (3 robust sigmas), refit
        wx, wy = x[train] * root[train], y[train] * root[train, 0]
        extra_x, extra_y = _prior_rows(wx, wy, prior)
        coef = _nonneg_lstsq(np.vstack([wx, extra_x]), np.concatenate([wy, extra_y]))
        res = y - x @ coef
        sigma = _robust_sigma(res[train], None if weights is None else w[train])
        keep = ~held & (np.abs(res) <= 3 * sigma)
        if keep.sum() < 3 or (keep == train).all():
            break
        train = keep
    pred = x @ coef
    total = abs(pred[held].sum() - y[held].sum()) / max(y[held].sum(), 1e-9) * 100 if held.any() else 0.0
    return LinearModel(*map(float, coef), train_error=_mape(pred[train], y[train]),
                       heldout_error=_mape(pred[held], y[held]) if held.any() else 0.0,
                       heldout_total_error=float(total), steps=len(y), outliers=int((~held & ~train).sum()))


MIN_OTHER_SIZES = 3   # prefill steps off the usual size needed to tell a prefill step's fixed cost (g) from b


def _sizes_vary(tokens: np.ndarray) -> bool:
    """Whether at least MIN_OTHER_SIZES steps are more than 25 % off the median size. A run's first steps are often
    full chunks of one size: there g + size x b is one number, and a split that put 80 ms into g (SmolLM2, bf16,
    longest first: ten 1,024-token chunks and one of 716) priced the half-size chunks that followed 42 % high."""
    middle = np.median(tokens) if len(tokens) else 0.0
    return int(np.sum(np.abs(tokens - middle) > 0.25 * middle)) >= MIN_OTHER_SIZES


def _robust_sigma(residuals: np.ndarray, weights: np.ndarray | None = None) -> float:
    """The residuals' standard deviation from their (weighted) median absolute value (stalls do not inflate it)."""
    size = np.abs(residuals)
    if weights is None:
        return 1.4826 * float(np.median(size)) + 1e-9
    order = np.argsort(size)
    cumulative = np.cumsum(weights[order])
    return 1.4826 * float(size[order][np.searchsorted(cumulative, cumulative[-1] / 2)]) + 1e-9


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (time never falls with more work, and a step never takes less
    than nothing): the best of the fits on each subset of the columns whose coefficients all come out >= 0."""
    best, best_residual = np.zeros(x.shape[1]), float(y @ y)
    columns = [i for i in range(x.shape[1]) if x[:, i].any()]
    for size in range(1, len(columns) + 1):
        for cols in itertools.combinations(columns, size):
            sub, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            if (sub < 0).any():
                continue
            residual = float(np.sum((y - x[:, cols] @ sub) ** 2))
            if residual < best_residual:
                best, best_residual = np.zeros(x.shape[1]), residual
                best[list(cols)] = sub
    return best
