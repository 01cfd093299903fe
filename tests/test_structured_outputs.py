"""Structured outputs on the tiny random model: whatever the weights, a request that finishes with "stop" matches its
schema, regex or choices (by construction of the token masks), also across preemption."""
import json
import re

import jsonschema
import pytest
import torch

from batchrun import LLM, SamplingParams
from conftest import random_prompts

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "kind": {"enum": ["cat", "dog"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
                         "owner": {"type": "object", "properties": {"id": {"type": "integer"}},
                                   "required": ["id"], "additionalProperties": False}},
          "required": ["name", "age", "kind", "tags", "owner"], "additionalProperties": False}
# xgrammar's JSON strings admit raw control characters (U+0001-U+001F but CR and LF), which strict JSON wants escaped:
# parse leniently here (the job's parse_json column re-serialises them escaped).
def loads(text):
    return json.loads(text, strict=False)


REGEX = r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)"
PROMPTS = random_prompts([5, 9, 13, 3, 21, 7], seed=1)


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(model=tiny_model[0], block_size=4, kv_cache_memory="4MiB")


def run(llm, temperature=1.0, max_tokens=120, **constraint):
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i, **constraint)
              for i in range(len(PROMPTS))]
    return llm.generate(PROMPTS, params, use_tqdm=False)


def finished(outs, at_least=None):
    done = [o for o in outs if o.finish_reason == "stop"]
    assert len(done) >= (len(outs) // 2 if at_least is None else at_least), [(o.finish_reason, o.text) for o in outs]
    return done


def test_json_schema_outputs_validate(llm):
    for out in finished(run(llm, json_schema=SCHEMA)) + finished(run(llm, temperature=0, json_schema=SCHEMA)):
        value = loads(out.text)
        jsonschema.validate(value, SCHEMA)
        assert list(value) == list(SCHEMA["properties"])   # generated in the schema's order


def test_regex_and_choice(llm):
    for out in finished(run(llm, regex=REGEX)):
        assert re.fullmatch(REGEX, out.text), out.text
    choices = ["yes", "no", "maybe so"]
    outs = finished(run(llm, choice=choices))
    assert all(o.text in choices for o in outs)
    assert len({o.text for o in run(llm, choice=choices)}) > 1   # sampled, not forced to one answer


def test_json_object_is_an_object(llm):
    for out in finished(run(llm, json_object=True, max_tokens=40), at_least=1):
        assert isinstance(loads(out.text), dict)


def test_constrained_and_mixed_batch_keep_free_requests_exact(llm):
    """In one batch, free requests give the same tokens as without the constrained ones beside them."""
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate(PROMPTS, free, use_tqdm=False)
    mixed = llm.generate(PROMPTS + PROMPTS, [free] * len(PROMPTS) + [SamplingParams(max_tokens=12, regex=REGEX)]
                         * len(PROMPTS), use_tqdm=False)
    assert [o.token_ids for o in alone] == [o.token_ids for o in mixed[:len(PROMPTS)]]


def test_mask_that_allows_the_greedy_token_changes_nothing(llm):
    """Greedy tokens under a grammar equal the free ones for as long as the grammar accepts the free ones (any
    text: the random model soon picks a byte that is no valid UTF-8 on its own, which the grammar refuses)."""
    free = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    anything = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                    regex=r"[\s\S]*"), use_tqdm=False)
    compared = 0
    for a, b in zip(free, anything):
        matcher = llm.engine._grammars.matcher("regex", r"[\s\S]*")
        n = next((i for i, t in enumerate(a.token_ids) if not matcher.accept_token(t)), len(a.token_ids))
        assert a.token_ids[:n] == b.token_ids[:n]
        assert n == len(a.token_ids) or b.token_ids[n] != a.token_ids[n]
        compared += n
    assert compared >= 5


def test_mask_bans_exactly_the_refused_tokens(llm):
    """Allowed logits are left as they are (so is the argmax where it is allowed); refused ones become -inf."""
    matcher = llm.engine._grammars.matcher("grammar", 'root ::= "yes" | "no"')
    logits = torch.randn(3, llm.engine.hf_config.vocab_size)
    masked = logits.clone()
    llm.engine._grammars.mask(masked, [None, matcher, None])
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    allowed = masked[1] > float("-inf")
    assert 1 <= int(allowed.sum()) < 10
    assert torch.equal(masked[1][allowed], logits[1][allowed])
    text = [llm.tokenizer.decode([t]) for t in allowed.nonzero()[:, 0].tolist()]
    assert all("yes".startswith(t) or "no".startswith(t) for t in text), text


def test_preemption_keeps_outputs_valid_and_equal(tiny_model):
    path, _ = tiny_model
    roomy = LLM(model=path, block_size=4, kv_cache_memory="4MiB")
    # 512 bytes per token (2 layers x 2 kv heads x 16 dims x K,V x 4 bytes): a 96-token pool for 6 requests
    tight = LLM(model=path, block_size=4, kv_cache_memory=512 * 96, max_model_len=96, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=70, temperature=0, json_schema=SCHEMA)
    a = roomy.generate(PROMPTS, params, use_tqdm=False)
    b = tight.generate(PROMPTS, params, use_tqdm=False)
    assert tight.engine.stats.preemptions > 0
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for out in b:
        if out.finish_reason == "stop":
            jsonschema.validate(loads(out.text), SCHEMA)
    tight.engine.block_manager.check_integrity()


@pytest.mark.parametrize("field,value,message", [
    ("regex", "a(b", "regex: Regex parsing error"),
    ("json_schema", "{not json", "json_schema: not valid JSON"),
    ("json_schema", {"type": "objectx"}, 'json_schema: Unsupported type "objectx"'),
    ("choice", [], "choice: must be a non-empty list"),
    ("grammar", "root ::= ", "grammar: EBNF parser error"),
])
def test_bad_constraints_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**{field: value})


def test_two_constraints_refused():
    with pytest.raises(ValueError, match="give one of"):
        SamplingParams(regex="a", choice=["b"])
