"""Sampling options, stop conditions, logprobs and the LLM API shapes on the tiny model."""
import torch

from batchrun import SamplingParams
from conftest import random_prompts


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_llm):
    prompt = random_prompts([7])[0]
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, top_k=50, seed=123, ignore_eos=True)
    alone = tiny_llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    others = SamplingParams(max_tokens=10, temperature=1.0, seed=5, ignore_eos=True)
    batch = tiny_llm.generate([prompt] + random_prompts([5, 9], seed=4), [params, others, others], use_tqdm=False)
    assert batch[0].token_ids == alone
    unseeded = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    runs = {tuple(tiny_llm.generate([prompt], unseeded, use_tqdm=False)[0].token_ids) for _ in range(3)}
    assert len(runs) > 1


def test_top_k_one_is_greedy(tiny_llm):
    prompts = random_prompts([4, 11])
    greedy = tiny_llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    topk = tiny_llm.generate(prompts, SamplingParams(max_tokens=8, temperature=1.5, top_k=1, ignore_eos=True),
                             use_tqdm=False)
    assert [o.token_ids for o in greedy] == [o.token_ids for o in topk]


def test_logprobs_match_reference(tiny_llm, tiny_model):
    prompt = random_prompts([6])[0]
    out = tiny_llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0, logprobs=True, ignore_eos=True),
                            use_tqdm=False)[0]
    full = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = tiny_model[1](full).logits[0, len(prompt) - 1:-1]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4)


def test_stop_token_ids_and_eos(tiny_llm):
    prompt = random_prompts([5])[0]
    free = tiny_llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                             use_tqdm=False)[0]
    stop_at = free.token_ids[3]
    out = tiny_llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at],
                                                     ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[:free.token_ids.index(stop_at) + 1]


def test_stop_string_cuts_text(tiny_llm):
    prompt = random_prompts([5])[0]
    free = tiny_llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                             use_tqdm=False)[0]
    stop = free.text[len(free.text) // 2:][:2]
    assert stop
    out = tiny_llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop=stop, ignore_eos=True),
                            use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert stop not in out.text and free.text.startswith(out.text)


def test_prompt_forms_and_order(tiny_llm):
    text = "The quick brown fox"
    ids = tiny_llm.tokenizer(text).input_ids
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    by_text, by_ids = tiny_llm.generate([text, ids], params, use_tqdm=False)
    assert by_text.token_ids == by_ids.token_ids and by_text.prompt_tokens == len(ids)
    single = tiny_llm.generate(text, params, use_tqdm=False)
    assert len(single) == 1 and single[0].token_ids == by_text.token_ids
    chat = tiny_llm.chat([{"role": "user", "content": text}], params, use_tqdm=False)[0]
    templated = tiny_llm.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                       add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat.prompt_tokens == len(templated)
    outs = tiny_llm.generate(random_prompts([30, 2, 15, 1]), [SamplingParams(max_tokens=m, temperature=0,
                                                                              ignore_eos=True) for m in (3, 9, 1, 5)],
                             use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [3, 9, 1, 5]
    assert all(o.latency is not None and o.time_to_first_token <= o.latency for o in outs)


def test_step_api_streams_tokens(tiny_llm):
    request = tiny_llm.add_request(random_prompts([5])[0], SamplingParams(max_tokens=4, temperature=0,
                                                                          ignore_eos=True))
    seen = []
    while tiny_llm.engine.has_unfinished():
        for out in tiny_llm.step():
            if out.request_id == request.request_id:
                seen.append(len(out.token_ids))
    assert seen == [1, 2, 3, 4]


def test_submit_streams_from_another_thread(tiny_llm):
    import threading
    prompt = random_prompts([6])[0]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = tiny_llm.generate([prompt], params, use_tqdm=False)[0]
    handles = []
    tiny_llm.start_background()
    try:
        threads = [threading.Thread(target=lambda: handles.append(tiny_llm.submit(prompt, params))) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        streamed = [[tok for chunk in h.stream(timeout=30) for tok in chunk.new_token_ids] for h in handles]
        assert streamed == [expected.token_ids] * 3
        assert all(h.result(timeout=5).text == expected.text for h in handles)
        slow = tiny_llm.submit(prompt, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
        next(slow.stream(timeout=30))
        slow.cancel()
        assert slow.result(timeout=30).finish_reason == "abort"
    finally:
        tiny_llm.stop_background()
    assert not tiny_llm.has_unfinished()
    assert tiny_llm.engine.block_manager.num_free_blocks == tiny_llm.engine.num_blocks


def test_handle_text_deltas_add_up_without_broken_characters():
    """Streaming decodes a short window per token; the deltas still join to the full decode, and a multi-byte
    character split across byte-level tokens arrives whole."""
    from batchrun.engine.handles import RequestHandle
    from batchrun.engine.request import RequestOutput
    from conftest import tiny_tokenizer
    tok = tiny_tokenizer()
    ids = tok.encode("Paris ist schön: café, naïve — 東京 🙂 The quick brown fox.")
    full = tok.decode(ids, skip_special_tokens=True)
    handle = RequestHandle("r", tok, cancel=lambda _: None)
    for n in range(1, len(ids)):
        handle._push(RequestOutput("r", 3, ids[:n], None, False, None))
    final = RequestOutput("r", 3, ids, full, True, "stop")
    final.prompt_outputs = [final]   # as the engine sends a prompt's last output
    handle._push(final)
    chunks = list(handle.stream(timeout=1))
    assert "".join(c.new_text for c in chunks) == full
    assert not any("\ufffd" in c.new_text for c in chunks)
    assert sum(1 for c in chunks if c.new_text) > len(full.split()) // 2   # text flows while streaming
