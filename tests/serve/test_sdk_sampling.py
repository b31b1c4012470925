"""logprobs / top_logprobs, n, top_k and the penalties, and POST /v1/completions through a real
`zlc serve` and the official `openai` / `anthropic` SDKs. Oracles: the reference executor's logits
of the whole sequence (one prefill with every position's logits) for logprobs (1e-4) and the
penalties; n choices with a seed equal the same seeds sent one by one; lm-evaluation-harness's
`local-completions` loglikelihood request replayed with its own parsing rule (sum of
token_logprobs[ctxlen:-1], greedy when each is its top alternative)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from serve_helpers import anthropic_client, metric, openai_client

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

MODEL = "llama-chat"
USER = [{"role": "user", "content": "Hello there"}]


def log_softmax_rows(session: Any, ids: list[int]) -> np.ndarray:
    """[len(ids), vocab]: row i is the log-softmax of the logits after ids[:i + 1] (float64)."""
    session.reset()
    _, lg = session.prefill(ids, all_logits=True, want_logits=True)
    x = np.asarray(lg, dtype=np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def greedy(session: Any, bundle: Any, prompt: list[int], n: int) -> list[int]:
    session.reset()
    return list(session.stream(prompt, n, eos=bundle.eos_token_ids))


def text_of(bundle: Any, tok: int) -> str:
    return str(bundle.tokenizer.decode([tok], skip_special_tokens=False))


def test_chat_logprobs_equal_the_reference_log_softmax(server: Any, bundle: Any, session: Any) -> None:
    prompt = bundle.tokenizer.encode_chat(USER)
    gen = [t for t in greedy(session, bundle, prompt, 6) if t not in bundle.eos_token_ids]
    ref = log_softmax_rows(session, prompt + gen)[len(prompt) - 1:]
    r = openai_client(server).chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0,
                                                      logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [text_of(bundle, t) for t in gen]
    for k, (c, tok) in enumerate(zip(content, gen, strict=True)):
        assert c.logprob == pytest.approx(ref[k, tok], abs=1e-4)
        assert c.bytes == list(c.token.encode())
        order = np.argsort(-ref[k], kind="stable")[:3]
        assert [a.token for a in c.top_logprobs] == [text_of(bundle, int(j)) for j in order]
        assert [a.logprob for a in c.top_logprobs] == pytest.approx([ref[k, j] for j in order], abs=1e-4)
        assert c.top_logprobs[0].logprob == c.logprob  # greedy: the chosen token is the most likely
    # streaming: the same entries, spread over the chunks
    with openai_client(server).chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0,
                                                       logprobs=True, top_logprobs=3, stream=True) as s:
        streamed = [e for ch in s if ch.choices and ch.choices[0].logprobs
                    for e in (ch.choices[0].logprobs.content or [])]
    assert [e.token for e in streamed] == [c.token for c in content]
    # (the second request may find the prompt in a cached slot: logits to rounding, not bit for bit)
    assert [e.logprob for e in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)
    # logprobs without alternatives
    r = openai_client(server).chat.completions.create(model=MODEL, messages=USER, max_tokens=3, temperature=0,
                                                      logprobs=True)
    assert [c.top_logprobs for c in r.choices[0].logprobs.content] == [[]] * len(r.choices[0].logprobs.content)


def test_n_choices_equal_their_seeds_sent_one_by_one(server: Any) -> None:
    o = openai_client(server)
    kw: dict[str, Any] = {"model": MODEL, "messages": USER, "max_tokens": 8, "temperature": 1.3}
    r = o.chat.completions.create(n=3, seed=41, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    alone = [o.chat.completions.create(seed=41 + i, **kw).choices[0].message.content for i in range(3)]
    assert [c.message.content for c in r.choices] == alone
    assert len(set(alone)) > 1  # different seeds: the choices differ (this model and temperature)
    # streaming: each choice's deltas by index give the same texts
    texts = ["", "", ""]
    with o.chat.completions.create(n=3, seed=41, stream=True, **kw) as s:
        for ch in s:
            for c in ch.choices:
                texts[c.index] += c.delta.content or ""
    assert texts == alone
    one = o.chat.completions.create(seed=41, **kw)
    assert r.usage is not None and one.usage is not None and r.usage.prompt_tokens == one.usage.prompt_tokens


def test_penalties_and_top_k_through_the_sdks(server: Any, bundle: Any, session: Any) -> None:
    o = openai_client(server)
    prompt = bundle.tokenizer.encode_chat(USER)
    r = o.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, temperature=0, frequency_penalty=1.5,
                                  presence_penalty=0.5, logprobs=True)
    toks = [e.token for e in r.choices[0].logprobs.content]
    # the hand-computed reference: replay the generated tokens, penalize, argmax
    ids: list[int] = []
    for k in range(len(toks)):
        lg = log_softmax_rows(session, prompt + ids)[-1]  # a log-softmax shifts all logits alike: same argmax
        x = lg.astype(np.float32)
        for j in set(ids):
            x[j] -= ids.count(j) * np.float32(1.5) + np.float32(0.5)
        ids.append(int(np.argmax(x)))
        assert toks[k] == text_of(bundle, ids[-1])
    # top_k 1 samples the argmax whatever the temperature (OpenAI: an extra field; Anthropic: top_k)
    plain = o.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0)
    hot = o.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=1.5, seed=3,
                                    extra_body={"top_k": 1})
    assert hot.choices[0].message.content == plain.choices[0].message.content
    a = anthropic_client(server)
    # (today's Anthropic SDK has no sampling arguments: they go as extra body fields)
    m = a.messages.create(model=MODEL, max_tokens=6, messages=USER,  # type: ignore[arg-type]
                          extra_body={"temperature": 1.0, "top_k": 1})
    assert m.content[0].text == plain.choices[0].message.content


@pytest.mark.parametrize(("field", "body"), [
    ("n", {"n": 9}), ("top_logprobs", {"logprobs": True, "top_logprobs": 21}),
    ("top_k", {"top_k": -1}), ("top_logprobs", {"top_logprobs": 2}), ("frequency_penalty", {"frequency_penalty": 3}),
])
def test_bad_sampling_options_are_one_400_naming_the_field(server: Any, field: str, body: dict[str, Any]) -> None:
    before = metric(server, "zlc_prompt_tokens_total")
    with pytest.raises(openai.BadRequestError) as e:
        openai_client(server).chat.completions.create(model=MODEL, messages=USER, max_tokens=2,  # type: ignore[arg-type]
                                                      extra_body=body)
    assert e.value.status_code == 400 and e.value.param == field and field in e.value.message
    a = anthropic_client(server)
    with pytest.raises(anthropic.BadRequestError) as ea:
        a.messages.create(model=MODEL, max_tokens=2, messages=USER, extra_body={"top_k": -1})  # type: ignore[arg-type]
    assert "top_k" in ea.value.body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as ec:
        openai_client(server).completions.create(model=MODEL, prompt="Hi", max_tokens=2, logprobs=21)
    assert ec.value.param == "logprobs"
    for prompt in ([1, 10**6], ["a", "b"], [], [[1], [2]]):
        with pytest.raises(openai.BadRequestError) as ec:
            openai_client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=2)  # type: ignore[arg-type]
        assert ec.value.param == "prompt" and "prompt" in ec.value.message
    assert metric(server, "zlc_prompt_tokens_total") == before  # nothing reached the engine


def test_completions_text_stream_stop_and_token_ids(server: Any, bundle: Any, session: Any) -> None:
    o = openai_client(server)
    prompt = "Once upon a time"
    ids = bundle.tokenizer.encode(prompt)
    gen = [t for t in greedy(session, bundle, ids, 8) if t not in bundle.eos_token_ids]
    want = bundle.tokenizer.decode(gen)
    r = o.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == want
    assert r.usage is not None and r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(gen) + (
        r.choices[0].finish_reason == "stop")
    assert o.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0).choices[0].text == want
    streamed = "".join(c.choices[0].text for c in o.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                                                        temperature=0, stream=True) if c.choices)
    assert streamed == want
    echo = o.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, echo=True)
    assert echo.choices[0].text == prompt + want
    # a one-token prompt echoed with logprobs: its token (null: nothing predicts it), then the answer's
    one = o.completions.create(model=MODEL, prompt=ids[:1], max_tokens=1, temperature=0, echo=True, logprobs=0)
    lp = one.choices[0].logprobs
    first = [t for t in greedy(session, bundle, ids[:1], 1) if t not in bundle.eos_token_ids]
    assert lp is not None and lp.tokens == [text_of(bundle, t) for t in ids[:1] + first]
    assert lp.token_logprobs[0] is None and lp.top_logprobs == [None] + [{}] * len(first)
    if len(want) > 2:
        stop = want[1:3]
        cut = o.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stop=[stop])
        assert cut.choices[0].text == want[:want.index(stop)] and cut.choices[0].finish_reason == "stop"


def lm_eval_parse_logprobs(out: dict[str, Any], ctxlen: int) -> tuple[float, bool]:
    """lm-evaluation-harness 0.4.x LocalCompletionsAPI.parse_logprobs, for one choice."""
    choice = out["choices"][0]
    logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
    is_greedy = all(tok == max(top.values()) for tok, top in zip(choice["logprobs"]["token_logprobs"][ctxlen:-1],
                                                                 choice["logprobs"]["top_logprobs"][ctxlen:-1],
                                                                 strict=True))
    return logprobs, is_greedy


def test_lm_eval_loglikelihood_request_replayed(server: Any, bundle: Any, session: Any) -> None:
    """The harness's loglikelihood payload (_create_payload with generate=False), tokens as it sends
    them ([[ids]]), parsed its way: the continuation's summed logprob equals the reference's."""
    import json
    import urllib.request

    context = bundle.tokenizer.encode("The capital of France is")
    continuation = bundle.tokenizer.encode(" Paris", add_special_tokens=False)
    payload = {"model": MODEL, "prompt": [context + continuation], "temperature": 0, "max_tokens": 1, "logprobs": 1,
               "seed": 1234, "echo": True}
    req = urllib.request.Request(server.base_url + "/v1/completions", data=json.dumps(payload).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        out = json.loads(resp.read())
    lp = out["choices"][0]["logprobs"]
    full = context + continuation
    assert len(lp["token_logprobs"]) == len(full) + 1  # the prompt, then the one generated token
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = log_softmax_rows(session, full)
    for i in range(1, len(full)):
        assert lp["token_logprobs"][i] == pytest.approx(ref[i - 1, full[i]], abs=1e-4)
        best = int(np.argmax(ref[i - 1]))
        assert lp["top_logprobs"][i] == pytest.approx({text_of(bundle, best): ref[i - 1, best]}, abs=1e-4)
    total, is_greedy = lm_eval_parse_logprobs(out, len(context))
    want = sum(ref[i - 1, full[i]] for i in range(len(context), len(full)))
    assert total == pytest.approx(want, abs=1e-3)
    assert is_greedy == all(int(np.argmax(ref[i - 1])) == full[i] for i in range(len(context), len(full)))
    # the same through the SDK's completions client, streaming: the echoed prompt's logprobs come first
    chunks = list(openai_client(server).completions.create(model=MODEL, prompt=full, max_tokens=1, temperature=0,
                                                           logprobs=1, echo=True, stream=True))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs
                for x in c.choices[0].logprobs.token_logprobs or []]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-6)


def test_n_choices_share_the_prompts_pages(start_server: Any) -> None:
    """On the native batched kernel (paged KV, prefix cache): choices 1.. n - 1 find the prompt's
    full pages that choice 0 computed, so the prompt is prefilled once."""
    s = start_server("--device", "cpu")
    o = openai_client(s)
    words = " ".join(f"w{i}" for i in range(30))
    msgs = [{"role": "user", "content": words}]
    before = metric(s, "zlc_engine_prefix_tokens")
    r = o.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, n=4, temperature=0.9, seed=7)
    assert len(r.choices) == 4
    n_prompt = r.usage.prompt_tokens if r.usage else 0
    assert metric(s, "zlc_engine_prefix_tokens") - before == 3 * ((n_prompt - 1) // 16 * 16)
    alone = [o.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0.9, seed=7 + i)
             .choices[0].message.content for i in range(4)]
    assert [c.message.content for c in r.choices] == alone
