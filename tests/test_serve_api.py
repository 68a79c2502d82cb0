"""The OpenAI-compatible server, driven over HTTP by the official `openai` client and by httpx.

One server subprocess (tiny model, CPU) serves the whole module. Every text it returns is
compared with `LLM.generate` in this process on the same seeds: non-streamed == streamed ==
offline.
"""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from paxkv import LLM, SamplingParams
from serve_helpers import ServerProcess, compile_cache_env, use_compile_cache

ENGINE_ARGS = dict(max_num_seqs=64, max_model_len=256, max_num_batched_tokens=256, seed=0)
PROMPTS = ["It is a truth universally acknowledged", "Mr. Darcy walked into the room",
           "Elizabeth could not help", "The weather at Longbourn", "Lady Catherine said that",
           "Jane wrote to her sister"]


def _flags(args: dict) -> list[str]:
    return [f for k, v in args.items() for f in (f"--{k.replace('_', '-')}", str(v))]


@pytest.fixture(scope="module")
def cache_dir(request):
    # Compiled step programs survive between runs (on 2 CPU cores each takes seconds).
    return str(request.config.cache.mkdir("paxkv_jax_compile_cache"))


@pytest.fixture(scope="module")
def server(cache_dir):
    s = ServerProcess(["tiny", *_flags(ENGINE_ARGS)], env=compile_cache_env(cache_dir))
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def llm(cache_dir):
    use_compile_cache(cache_dir)
    return LLM("tiny", **ENGINE_ARGS)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _offline(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0]


def _stream_texts(stream) -> tuple[dict[int, str], dict[int, str], dict | None]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


@pytest.mark.slow
def test_models_health_and_tokenize(server, llm):
    assert httpx.get(f"{server.url}/health").status_code == 200
    models = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x").models.list()
    assert [m.id for m in models.data] == ["tiny"]
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPTS[0]}).json()
    assert r["tokens"] == llm.get_tokenizer().encode(PROMPTS[0])
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    r2 = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert r2["prompt"] == PROMPTS[0]


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=0.9, top_p=0.9, seed=7),
                                dict(temperature=1.0, top_k=20, seed=11, n=2)])
def test_completion_stream_and_offline_agree(client, llm, kw):
    n = kw.get("n", 1)
    extra = {k: kw[k] for k in ("top_k",) if k in kw}
    api = {k: v for k, v in kw.items() if k not in extra}
    full = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=40,
                                     extra_body=extra, **api)
    stream = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=40, stream=True,
                                       stream_options={"include_usage": True}, extra_body=extra, **api)
    texts, reasons, usage = _stream_texts(stream)
    ref = _offline(llm, PROMPTS[1], max_tokens=40, **kw)
    assert len(full.choices) == n
    for i in range(n):
        assert full.choices[i].text == texts[i] == ref.outputs[i].text
        assert full.choices[i].finish_reason == reasons[i] == ref.outputs[i].finish_reason
    assert full.usage.prompt_tokens == usage.prompt_tokens == len(ref.prompt_token_ids)
    assert full.usage.completion_tokens == usage.completion_tokens == sum(
        len(o.token_ids) for o in ref.outputs)


@pytest.mark.slow
def test_chat_stream_and_offline_agree(client, llm):
    messages = [{"role": "system", "content": "You write like Jane Austen."},
                {"role": "user", "content": "Describe a ball at Netherfield."}]
    kw = dict(temperature=0.8, seed=3, max_tokens=48)
    full = client.chat.completions.create(model="tiny", messages=messages, **kw)
    stream = client.chat.completions.create(model="tiny", messages=messages, stream=True, **kw)
    texts, reasons, _ = _stream_texts(stream)
    ids = llm.get_tokenizer().apply_chat_template(messages)
    ref = _offline(llm, ids, **kw)
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == texts[0] == ref.outputs[0].text
    assert full.choices[0].finish_reason == reasons[0] == ref.outputs[0].finish_reason
    assert full.usage.prompt_tokens == len(ids)
    # max_completion_tokens is the newer name of max_tokens
    short = client.chat.completions.create(model="tiny", messages=messages, temperature=0.0,
                                           max_completion_tokens=5)
    assert short.usage.completion_tokens == 5 and short.choices[0].finish_reason == "length"


def test_stop_strings_streamed_and_not(client, llm):
    greedy = _offline(llm, PROMPTS[0], temperature=0.0, max_tokens=40).outputs[0].text
    words = greedy.split()
    stop = " " + words[len(words) // 2]        # a word that greedy decoding reaches mid-way
    full = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=40,
                                     temperature=0.0, stop=[stop, "@@never@@"])
    texts, reasons, _ = _stream_texts(client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=40, temperature=0.0, stop=[stop, "@@never@@"],
        stream=True))
    ref = _offline(llm, PROMPTS[0], temperature=0.0, max_tokens=40, stop=[stop, "@@never@@"])
    assert full.choices[0].text == texts[0] == ref.outputs[0].text == greedy[:greedy.index(stop)]
    assert full.choices[0].finish_reason == reasons[0] == "stop"
    assert full.choices[0].stop_reason == stop


def test_logprobs(client, llm):
    full = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=8,
                                     temperature=0.0, logprobs=2)
    ref = _offline(llm, PROMPTS[2], max_tokens=8, temperature=0.0, logprobs=2).outputs[0]
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    for got, want_tok, want in zip(lp.token_logprobs, ref.token_ids, ref.logprobs):
        assert got == pytest.approx(want[want_tok], abs=1e-4)
    assert all(len(t) >= 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert all(c.logprob <= 0 for c in content)


def test_token_prompts_batches_and_echo(client, llm):
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS[:3]]
    full = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0.0)
    refs = llm.generate(ids, SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert [c.index for c in full.choices] == [0, 1, 2]
    assert [c.text for c in full.choices] == [r.outputs[0].text for r in refs]
    echo = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=4, temperature=0.0,
                                     echo=True)
    assert echo.choices[0].text.startswith(PROMPTS[3])
    texts, _, _ = _stream_texts(client.completions.create(
        model="tiny", prompt=PROMPTS[3], max_tokens=4, temperature=0.0, echo=True, stream=True))
    assert texts[0] == echo.choices[0].text
    echo_ids = client.completions.create(model="tiny", prompt=ids[0], max_tokens=4, temperature=0.0,
                                         echo=True)   # a token-id prompt is decoded to echo it
    assert echo_ids.choices[0].text.startswith(tok.decode(ids[0]))
    best = client.completions.create(model="tiny", prompt=PROMPTS[4], max_tokens=6, n=2, best_of=3,
                                     temperature=1.0, seed=5)
    ref = _offline(llm, PROMPTS[4], max_tokens=6, n=2, best_of=3, temperature=1.0, seed=5)
    assert [c.text for c in best.choices] == [o.text for o in ref.outputs]


BAD_COMPLETIONS = [
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": 0}, "top_k"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 10**9}, "n"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "seed": 2**40}, "seed"),
    ({"prompt": "x", "logprobs": 1000}, "logprobs"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "n": 2, "best_of": 1}, "best_of"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "repetition_penalty": 0.0}, "repetition_penalty"),
    ({"prompt": "x", "logit_bias": {"five": 1.0}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"99999": 1.0}}, "logit_bias"),
    ({"prompt": "x", "allowed_token_ids": [99999]}, "allowed_token_ids"),
    ({"prompt": "x", "bad_words": "word"}, "bad_words"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": 1000}, "prompt_logprobs"),
    ({"prompt": "x", "guided_grammar": "start: ("}, "guided_grammar"),
    ({"prompt": "x", "guided_regex": "(unclosed"}, "guided_regex"),
    ({"prompt": "x", "guided_json": "{not json"}, "guided_json"),
    ({"prompt": "x", "guided_json": {"type": "object"}, "guided_choice": ["a"]}, "guided_json"),
    ({"prompt": "x", "guided_choice": []}, "guided_choice"),
    ({"prompt": "x", "structured_outputs": {}}, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"grammar": "start: ("}}, "structured_outputs"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
     "response_format"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "object", "properties": {"a": {"type": "bogus"}}}}}},
     "response_format"),
    ({"prompt": "x", "response_format": {"type": "yaml"}}, "response_format.type"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": [5, 10**7]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "word " * 400}, "prompt"),
    ({"prompt": "x", "stop_token_ids": [99999]}, "stop_token_ids"),
    ({"max_tokens": 3}, "prompt"),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS)
def test_bad_completion_requests_are_400_naming_the_field(server, body, param):
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["message"]


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1},
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 100},
     "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi " * 400}]}, "messages"),
])
def test_bad_chat_requests_are_400_naming_the_field(server, body, param):
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_malformed_bodies_and_unknown_model(server):
    for raw in (b"{not json", b"[1, 2]", b"", b'"prompt"'):
        r = httpx.post(f"{server.url}/v1/completions", content=raw,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", raw
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0).completions.create(
            model="gpt-9", prompt="x")
    # The server still serves after all of that.
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


async def _stream_one(url: str, prompt: str, seed: int) -> tuple[str, int]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300)
    stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=16,
                                             temperature=0.8, seed=seed, stream=True,
                                             stream_options={"include_usage": True})
    text, tokens = "", 0
    async for chunk in stream:
        for c in chunk.choices:
            text += c.text
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    await client.close()
    return text, tokens


@pytest.mark.slow
def test_64_concurrent_streams_each_get_what_they_get_alone(server, llm):
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i % 3) for i in range(64)]

    async def run_all():
        return await asyncio.gather(*[_stream_one(server.url, p, i) for i, p in enumerate(prompts)])

    results = asyncio.run(run_all())
    # Alone: a few through the server, every one through the offline engine.
    for i in (0, 21, 63):
        assert asyncio.run(_stream_one(server.url, prompts[i], i)) == results[i], i
    for i, (text, tokens) in enumerate(results):
        ref = _offline(llm, prompts[i], max_tokens=16, temperature=0.8, seed=i).outputs[0]
        assert (text, tokens) == (ref.text, len(ref.token_ids)), i


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    aborted_before = server.metric("paxkv:request_aborted_total")
    body = {"prompt": PROMPTS[5], "max_tokens": 200, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if (server.metric("paxkv:request_aborted_total") > aborted_before
                and server.metric("paxkv:num_requests_running") == 0):
            break
        time.sleep(0.1)
    assert server.metric("paxkv:request_aborted_total") == aborted_before + 1
    assert server.metric("paxkv:num_requests_running") == 0
    assert server.metric("paxkv:num_requests_waiting") == 0
    assert server.metric("paxkv:kv_cache_usage_perc") == 0
    assert server.metric("paxkv:generation_tokens_total") > 0


def test_metrics_names(server):
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("paxkv:num_requests_running", "paxkv:num_requests_waiting",
                 "paxkv:kv_cache_usage_perc", "paxkv:num_preemptions_total",
                 "paxkv:prefix_cache_queries_total", "paxkv:prefix_cache_hits_total",
                 "paxkv:prompt_tokens_total", "paxkv:generation_tokens_total",
                 "paxkv:time_to_first_token_seconds_bucket",
                 "paxkv:time_per_output_token_seconds_bucket",
                 "paxkv:e2e_request_latency_seconds_bucket"):
        assert name in text, name
    assert server.metric("paxkv:e2e_request_latency_seconds_count") > 0


# ---- structured outputs and the other sampling fields ---------------------------------------
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.mark.slow
def test_chat_response_format_json_schema_and_json_object(client, llm):
    import json

    from paxkv.sampling_params import StructuredOutputsParams
    jsonschema = pytest.importorskip("jsonschema")
    messages = [{"role": "user", "content": "Describe Mr. Darcy as JSON."}]
    for seed in (0, 1):
        r = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=120, temperature=0.8, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    # Any JSON object: a novel-trained model never closes its first string within a budget,
    # so the check is that the server asks the engine for exactly that grammar.
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24,
                                       temperature=1.0, seed=3, response_format={"type": "json_object"})
    prompt = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True)
    want = _offline(llm, prompt, max_tokens=24, temperature=1.0, seed=3,
                    structured_outputs=StructuredOutputsParams(json_object=True)).outputs[0]
    assert r.choices[0].message.content == want.text and want.text.startswith('{"')
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24,
                                           temperature=1.0, seed=3, response_format={"type": "text"})
    assert not plain.choices[0].message.content.startswith('{"')


def test_guided_choice_regex_and_structured_outputs_on_completions(server, llm):
    choices = ["Elizabeth Bennet", "Mr. Darcy", "Lady Catherine"]
    for seed in range(3):
        r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "prompt": PROMPTS[1], "max_tokens": 20, "temperature": 1.0, "seed": seed,
            "guided_choice": choices}).json()
        assert r["choices"][0]["text"] in choices, r
    import re
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0.9, "seed": 4,
        "guided_regex": pattern}).json()
    assert re.fullmatch(pattern, r["choices"][0]["text"]), r
    # vLLM's newer object gives what the offline engine gives.
    from paxkv.sampling_params import StructuredOutputsParams
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Yes or no?"}], "max_tokens": 10,
        "temperature": 0.0, "structured_outputs": {"choice": ["yes", "no"]}}).json()
    assert r["choices"][0]["message"]["content"] in ("yes", "no"), r
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0.0,
        "structured_outputs": {"regex": "[A-Z][a-z]+ [a-z]+"}}).json()
    want = _offline(llm, PROMPTS[2], max_tokens=12, temperature=0.0,
                    structured_outputs=StructuredOutputsParams(regex="[A-Z][a-z]+ [a-z]+"))
    assert r["choices"][0]["text"] == want.outputs[0].text


@pytest.mark.slow
def test_penalties_bias_allowed_ids_and_bad_words_equal_offline(server, llm):
    tok = llm.get_tokenizer()
    allowed = tok.encode(" the and of a to", add_special_tokens=False)
    cases = [dict(presence_penalty=0.7, frequency_penalty=0.6, repetition_penalty=1.3),
             dict(logit_bias={str(allowed[0]): 8.0, str(allowed[1]): -100.0}),
             dict(allowed_token_ids=allowed),
             dict(bad_words=["very happy", "be"])]
    plain = _offline(llm, PROMPTS[0], max_tokens=12, temperature=0.0).outputs[0]
    for kw in cases:
        r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0.0, **kw}).json()
        offline = dict(kw)
        if "logit_bias" in offline:   # JSON keys are strings; the offline API takes ids
            offline["logit_bias"] = {int(k): v for k, v in offline["logit_bias"].items()}
        want = _offline(llm, PROMPTS[0], max_tokens=12, temperature=0.0, **offline).outputs[0]
        assert r["choices"][0]["text"] == want.text, (kw, r)
        assert want.token_ids != plain.token_ids, kw        # the field changed the output
        if "allowed_token_ids" in kw:
            assert set(want.token_ids) <= set(allowed)


@pytest.mark.slow
def test_prompt_logprobs_equal_offline(server, llm):
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "prompt": [PROMPTS[3], PROMPTS[4]], "max_tokens": 3, "temperature": 0.0,
        "prompt_logprobs": 2}).json()
    for k, prompt in enumerate(PROMPTS[3:5]):
        want = _offline(llm, prompt, max_tokens=3, temperature=0.0, prompt_logprobs=2)
        got = r["choices"][k]["prompt_logprobs"]
        assert got[0] is None and len(got) == len(want.prompt_token_ids)
        for g, w in zip(got[1:], want.prompt_logprobs[1:]):
            assert sorted(int(t) for t in g) == sorted(w)
            for t, lp in w.items():
                assert g[str(t)]["logprob"] == pytest.approx(lp, abs=1e-4)
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 0}).json()
    entries = chat["prompt_logprobs"]
    assert entries[0] is None and all(len(e) == 1 for e in entries[1:])
    assert all(v["logprob"] <= 0 for e in entries[1:] for v in e.values())
