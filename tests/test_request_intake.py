"""Request intake (engine/validation.py): what the engine refuses, how it says so, and that a
refused or aborted request leaves nothing behind and disturbs nothing else in flight."""
from __future__ import annotations

import dataclasses
import math

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from engine_helpers import assert_no_leaks
from paxkv import LLM, SamplingParams
from paxkv.sampling_params import RequestOutputKind, StructuredOutputsParams

VOCAB = 4096


def run(tiny_llm, prompt, **kw):
    return tiny_llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0]


# ---- the cases of the issue, one by one --------------------------------------------------
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_temperature_must_be_finite(value):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=value)


@pytest.mark.parametrize("value,error", [("7", TypeError), (1.5, TypeError), (True, TypeError),
                                         (-1, ValueError), (2**31, ValueError)])
def test_seed_is_an_int_in_range(value, error):
    with pytest.raises(error, match="seed"):
        SamplingParams(seed=value)


@pytest.mark.parametrize("field", ["n", "best_of", "top_k", "max_tokens", "min_tokens", "logprobs",
                                   "prompt_logprobs"])
def test_bools_and_floats_are_not_ints(field):
    for value in (True, 2.0):
        with pytest.raises(TypeError, match=field):
            SamplingParams(**{field: value})


def test_numpy_scalars_are_accepted():
    p = SamplingParams(n=np.int64(2), temperature=np.float32(0.5), max_tokens=np.int32(4))
    assert (p.n, p.max_tokens) == (2, 4) and type(p.n) is int


def test_logprobs_capped_at_max_logprobs(tiny_llm):
    engine = tiny_llm.llm_engine
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{field} 21 exceeds max_logprobs 20"):
            engine.add_request("x", [1, 2, 3], SamplingParams(**{field: 21}))
    assert not engine.has_unfinished_requests()
    out = run(tiny_llm, [1, 2, 3], temperature=0.0, max_tokens=1, logprobs=20)
    assert len(out.outputs[0].logprobs[0]) >= 20


def test_max_logprobs_is_an_engine_argument():
    small = LLM("tiny", dtype="float32", num_gpu_blocks_override=32, max_model_len=64,
                max_num_seqs=2, max_num_batched_tokens=32, max_logprobs=2)
    with pytest.raises(ValueError, match="max_logprobs 2"):
        small.llm_engine.add_request("x", [1, 2], SamplingParams(logprobs=3))


@pytest.mark.parametrize("prompt,error", [([5.5, 6.25], TypeError), ([5, 6.0], TypeError),
                                          ([True, 3], TypeError), (b"bytes", TypeError),
                                          (17, TypeError), ([], ValueError), ([3, VOCAB], ValueError),
                                          ([-1], ValueError)])
def test_bad_prompts_name_the_prompt(tiny_llm, prompt, error):
    with pytest.raises(error, match="prompt"):
        tiny_llm.llm_engine.add_request("bad", prompt, SamplingParams())
    assert not tiny_llm.llm_engine.has_unfinished_requests()


def test_prompt_ids_of_every_integer_kind_check_alike(tiny_llm):
    """Lists of Python ints take a fast path; tuples and numpy integers the per-element one."""
    import numpy as np
    validator = tiny_llm.llm_engine.validator
    want = [5, 6, VOCAB - 1]
    for prompt in (want, tuple(want), [np.int32(5), 6, np.int64(VOCAB - 1)], np.array(want)):
        text, ids = validator.prompt(prompt)
        assert text is None and ids == want and all(type(t) is int for t in ids)


def test_generate_with_one_bad_prompt_queues_nothing(tiny_llm):
    engine = tiny_llm.llm_engine
    good = [[1, 30, 40], [1, 50, 60]]
    with pytest.raises(TypeError, match="prompt"):
        tiny_llm.generate(good + [[5.5]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.scheduler.num_waiting == 0
    with pytest.raises(ValueError, match="logprobs"):   # refused by the engine, not at construction
        tiny_llm.generate(good, [SamplingParams(), SamplingParams(logprobs=21)], use_tqdm=False)
    assert not engine.has_unfinished_requests()
    outs = tiny_llm.generate(good, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert len(outs) == 2 and all(len(o.outputs[0].token_ids) == 3 for o in outs)
    assert_no_leaks(tiny_llm)


def test_abort_contract(tiny_llm):
    """The aborted request's final output comes from the very next step, and
    has_unfinished_requests stays True until then; nothing of it reaches later work."""
    engine = tiny_llm.llm_engine
    engine.add_request("a", [1, 20, 30], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    engine.abort_request("a")
    assert engine.has_unfinished_requests()
    outs = engine.step()
    assert [o.request_id for o in outs] == ["a"]
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    engine.abort_request("a")               # already gone: ignored
    assert not engine.has_unfinished_requests()
    later = tiny_llm.generate([[1, 20, 30]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert [o.request_id for o in later] != ["a"]
    assert_no_leaks(tiny_llm)


def test_bad_grammar_is_refused_with_llguidance_error(tiny_llm):
    engine = tiny_llm.llm_engine
    with pytest.raises(ValueError, match="structured_outputs"):
        engine.add_request("g", "Hello", SamplingParams(
            structured_outputs=StructuredOutputsParams(grammar="start: foo\nfoo: ( \"a\"")))
    with pytest.raises(ValueError, match="structured_outputs"):
        engine.add_request("r", "Hello", SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="([a-")))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    assert not engine.has_unfinished_requests()


# ---- hypothesis: any input either is refused naming its field, or completes -------------------
INT_BAD = st.sampled_from(["7", 1.5, True, -5, None, [1]])
FLOAT_BAD = st.sampled_from(["0.5", math.nan, math.inf, -3.0, True, None])
BOOL_BAD = st.sampled_from([1, "yes", None, 0.0])
IDS = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=4)

VALID = {
    "n": st.integers(1, 2),
    "temperature": st.sampled_from([0.0, 0.7, 1.3]),
    "top_p": st.floats(0.2, 1.0),
    "top_k": st.sampled_from([-1, 1, 5, 50]),
    "min_p": st.floats(0.0, 0.3),
    "seed": st.one_of(st.none(), st.integers(0, 2**31 - 1)),
    "max_tokens": st.integers(1, 5),
    "min_tokens": st.integers(0, 1),
    "stop": st.sampled_from([None, "e", ["the", "and"]]),
    "stop_token_ids": st.one_of(st.none(), IDS),
    "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "logprobs": st.one_of(st.none(), st.integers(0, 3)),
    "detokenize": st.booleans(),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(0.5, 2.0),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=3),
    "allowed_token_ids": IDS,
    "bad_words": st.sampled_from([["the"], ["of her", "and"]]),
    "prompt_logprobs": st.one_of(st.none(), st.integers(0, 2)),
    "structured_outputs": st.sampled_from([StructuredOutputsParams(choice=["yes", "no"]),
                                           StructuredOutputsParams(regex="[a-z]{1,4}")]),
    "return_hidden_states": st.sampled_from([[0], [4], [1, 3]]),
    "output_kind": st.sampled_from(list(RequestOutputKind)),
}
INVALID = {
    "n": INT_BAD, "top_k": INT_BAD, "seed": st.sampled_from(["7", 1.5, True, -1, 2**40]),
    "max_tokens": st.sampled_from(["7", 1.5, True, 0]), "min_tokens": INT_BAD,
    "logprobs": st.sampled_from([1.5, True, -1, 21]), "prompt_logprobs": st.sampled_from([1.5, -1, 21]),
    "temperature": FLOAT_BAD, "top_p": st.sampled_from([0.0, 1.5, math.nan, "1"]),
    "min_p": st.sampled_from([-0.1, 1.5, math.inf]), "presence_penalty": FLOAT_BAD,
    "frequency_penalty": st.sampled_from([2.5, math.nan, "1"]),
    "repetition_penalty": st.sampled_from([0.0, -1.0, math.inf, "1"]),
    "ignore_eos": BOOL_BAD, "detokenize": BOOL_BAD, "include_stop_str_in_output": BOOL_BAD,
    "stop": st.sampled_from([5, [""], [1]]),
    "stop_token_ids": st.sampled_from([[1.5], "abc", [-1], [VOCAB]]),
    "logit_bias": st.sampled_from([{1.5: 1.0}, {1: math.nan}, [1], {VOCAB: 1.0}, {3: 101.0}]),
    "allowed_token_ids": st.sampled_from([[], [1.5], [VOCAB], 7]),
    "bad_words": st.sampled_from(["the", [""], [5]]),
    "structured_outputs": st.sampled_from(["json", StructuredOutputsParams(regex="([a-")]),
    "return_hidden_states": st.sampled_from([[99], [1.5], [], [0, 0]]),
    "output_kind": st.sampled_from([1, "DELTA", None]),
}
GOOD_PROMPT = st.one_of(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20),
                        st.sampled_from(["Emma", "It is a truth", "She said, \"No"]))
BAD_PROMPT = st.sampled_from([[], [5.5], [True, 2], [VOCAB], [-3], list(range(1, 300)), 5, None])

BACKGROUND = [([1, 1030, 369, 264], 6), ([1, 50, 51, 52, 53, 54], 7)]


@pytest.fixture(scope="module")
def clean_background(tiny_llm):
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in BACKGROUND]
    outs = tiny_llm.generate([p for p, _ in BACKGROUND], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@st.composite
def requests(draw):
    fields = draw(st.lists(st.sampled_from(sorted(VALID)), max_size=5, unique=True))
    kwargs = {f: draw(VALID[f]) for f in fields}
    broken = None
    choice = draw(st.integers(0, 3))
    if choice == 0:
        broken = draw(st.sampled_from(sorted(INVALID)))
        kwargs[broken] = draw(INVALID[broken])
    prompt = draw(BAD_PROMPT) if choice == 1 else draw(GOOD_PROMPT)
    return prompt, kwargs, broken, choice == 1


@pytest.mark.slow
@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(case=requests())
def test_any_request_is_refused_by_name_or_served(tiny_llm, clean_background, case):
    prompt, kwargs, broken, bad_prompt = case
    engine = tiny_llm.llm_engine
    for i, (p, m) in enumerate(BACKGROUND):
        engine.add_request(f"bg{i}", p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True))
    engine.step()
    refused = None
    try:
        engine.add_request("fuzz", prompt, SamplingParams(**kwargs))
    except (TypeError, ValueError) as e:
        refused = str(e)
    if broken is not None or bad_prompt:
        assert refused is not None, f"accepted {broken or 'prompt'}: {kwargs} {prompt!r}"
        assert (broken or "prompt") in refused, refused
    elif refused is not None:   # valid fields that conflict (best_of < n, min > max, ...)
        assert any(f in refused for f in list(kwargs) + ["prompt"]), refused
    assert set(engine.requests) <= {"bg0", "bg1", "fuzz"}
    if refused is not None:
        assert "fuzz" not in engine.requests
    done, fuzz_outputs = {}, []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == "fuzz":
                fuzz_outputs.append(o)
            if o.finished:
                done[o.request_id] = o
    assert [done[f"bg{i}"].outputs[0].token_ids for i in range(2)] == clean_background
    if refused is None:
        fuzz = done["fuzz"]
        samples = fuzz.outputs
        if kwargs.get("output_kind") is RequestOutputKind.DELTA:   # news only: join them
            ids: dict[int, list[int]] = {}
            ends = {}
            for o in fuzz_outputs:
                for c in o.outputs:
                    ids.setdefault(c.index, []).extend(c.token_ids)
                    if c.finish_reason is not None:
                        ends[c.index] = c
            samples = [dataclasses.replace(ends[i], token_ids=ids[i]) for i in sorted(ids)]
        assert len(samples) == kwargs.get("n", 1)
        for c in samples:
            assert c.finish_reason in ("stop", "length")
            assert 1 <= len(c.token_ids) <= kwargs.get("max_tokens", 16)
            assert all(0 <= t < VOCAB for t in c.token_ids)
            if kwargs.get("allowed_token_ids"):
                assert set(c.token_ids) <= set(kwargs["allowed_token_ids"])
    engine.scheduler.check_no_leaks()
    assert_no_leaks(tiny_llm)
