"""The sampler's math on its own: the mass top-k and top-p keep, the tokens they exclude, the frequencies it draws,
seeds independent of the batch."""
import math

import pytest
import torch

from batchrun.engine.request import Request
from batchrun.engine.sampler import Sampler, filtered_probs
from batchrun.sampling_params import SamplingParams

PROBS = [0.5, 0.3, 0.15, 0.05]


def logits(probs=PROBS, rows=1):
    return torch.tensor([[math.log(p) for p in probs]] * rows)


def kept(probs, ids):
    """token -> normalised kept probability, from filtered_probs' output row 0."""
    total = float(probs[0].sum())
    return {int(t): round(float(p) / total, 4) for p, t in zip(probs[0], ids[0]) if p > 0}


@pytest.mark.parametrize("params, expected", [
    (dict(top_p=0.8), {0: 0.625, 1: 0.375}),                   # mass before the 3rd token is 0.8: dropped
    (dict(top_p=0.81), {0: 0.5263, 1: 0.3158, 2: 0.1579}),
    (dict(top_k=2), {0: 0.625, 1: 0.375}),
    (dict(top_k=3, top_p=0.9), {0: 0.5263, 1: 0.3158, 2: 0.1579}),   # top-p over the renormalised top 3
    (dict(top_k=3, top_p=0.5), {0: 1.0}),                        # the most likely token always stays
])
def test_top_k_and_top_p_keep_the_right_mass(params, expected):
    assert kept(*filtered_probs(logits(), [SamplingParams(**params)])) == expected


def test_top_k_keeps_ties_and_a_wide_nucleus_sorts_the_whole_vocabulary():
    assert kept(*filtered_probs(logits([0.4, 0.4, 0.2]), [SamplingParams(top_k=1)])) == {0: 0.5, 1: 0.5}
    flat = torch.zeros(1, 3000)                                  # 1,024 candidates hold a third of the mass
    probs, ids = filtered_probs(flat, [SamplingParams(top_p=0.9001)])
    assert ids.shape[1] == 3000 and int((probs > 0).sum()) == 2701   # mass before token 2700: 0.9


def test_drawn_frequencies_follow_the_kept_distribution():
    n = 20000
    requests = [Request(str(i), [1], SamplingParams(temperature=1.0, top_p=0.81)) for i in range(n)]
    tokens, _ = Sampler(seed=1)(logits(rows=n), requests)
    counts = torch.bincount(torch.tensor(tokens), minlength=4) / n
    assert counts[3] == 0                                        # excluded by top-p: never drawn
    assert counts[:3].tolist() == pytest.approx([0.5263, 0.3158, 0.1579], abs=0.015)
    hot = [Request(str(i), [1], SamplingParams(temperature=2.0)) for i in range(n)]
    counts = torch.bincount(torch.tensor(Sampler(seed=2)(logits(rows=n), hot)[0]), minlength=4) / n
    flat = torch.softmax(logits()[0] / 2.0, dim=-1)
    assert counts.tolist() == pytest.approx(flat.tolist(), abs=0.015)


def test_a_masked_token_is_never_drawn():
    """Tokens of zero weight (a -inf logit, as a grammar's mask leaves them) sit at both ends of the cumulative
    weights and between the others: none is ever drawn, from rows of one or several tokens."""
    n = 20000
    masked = torch.tensor([[float("-inf"), 0.0, float("-inf"), 1.0, float("-inf")],
                           [float("-inf"), float("-inf"), float("-inf"), 3.0, float("-inf")]]).repeat(n // 2, 1)
    requests = [Request(str(i), [1], SamplingParams(temperature=1.0)) for i in range(n)]
    tokens = torch.tensor(Sampler(seed=4)(masked, requests)[0])
    assert set(tokens[0::2].tolist()) == {1, 3} and set(tokens[1::2].tolist()) == {3}
    assert float((tokens[0::2] == 3).float().mean()) == pytest.approx(math.e / (1 + math.e), abs=0.015)


def test_a_seeded_request_draws_the_same_tokens_in_any_batch():
    vocab = 2000
    torch.manual_seed(0)
    base = torch.randn(1, vocab)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=7)

    def draws(batch_params):
        request = Request("s", [1], seeded)
        sampler, out = Sampler(seed=3), []
        others = [Request(str(i), [1], p) for i, p in enumerate(batch_params)]
        for step in range(20):
            noise = torch.randn(len(others), vocab)
            tokens, _ = sampler(torch.cat([base, noise]), [request, *others])
            out.append(tokens[0])
        return out

    alone = draws([])
    assert draws([SamplingParams(temperature=1.0)] * 3) == alone
    assert draws([SamplingParams(top_k=5), SamplingParams(top_p=0.2, temperature=3.0)]) == alone
    assert len(set(alone)) > 1


def test_logprobs_are_of_the_chosen_token_under_the_raw_logits():
    requests = [Request("a", [1], SamplingParams(temperature=0, logprobs=True)),
                Request("b", [1], SamplingParams(temperature=1.0, top_k=1, logprobs=True))]
    tokens, logprobs = Sampler()(logits(rows=2), requests)
    assert tokens == [0, 0] and logprobs == pytest.approx([math.log(0.5)] * 2, abs=1e-5)
