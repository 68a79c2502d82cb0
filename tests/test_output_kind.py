"""RequestOutputKind (vLLM's): DELTA outputs, joined, are the CUMULATIVE output (tokens,
logprobs, text cut at stop strings, hidden states, finish reasons); FINAL_ONLY says nothing
until the end. Random prompts, n = 1 and 2, seeded sampling, stop strings, an abort."""
from __future__ import annotations

import random

import numpy as np
import pytest

from paxkv import RequestOutputKind, SamplingParams
from tests.engine_helpers import assert_no_leaks

DELTA, FINAL_ONLY, CUMULATIVE = (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY,
                                 RequestOutputKind.CUMULATIVE)


def _requests(seed: int) -> list[tuple[list[int] | str, dict]]:
    rng = random.Random(seed)
    out = []
    for i in range(6):
        prompt = ("It is a truth universally" if i == 0 else
                  [rng.randrange(3, 4000) for _ in range(rng.randint(3, 40))])
        kw = dict(temperature=0.0 if i % 3 == 0 else 0.9, seed=100 + i, n=1 + (i % 2),
                  max_tokens=rng.randint(4, 24), logprobs=2 if i % 2 else None,
                  stop=[" the", "e"] if i in (0, 3) else None, ignore_eos=i != 0)
        if i == 5:
            kw.update(return_hidden_states=[1], prompt_logprobs=1)
        out.append((prompt, kw))
    return out


def _run(llm, kind: RequestOutputKind, seed: int) -> dict[str, list]:
    """Every output the step loop returns, per request (from a cold prefix cache, so that
    every run computes the same thing)."""
    engine = llm.llm_engine
    engine.block_manager.reset_prefix_cache()
    for i, (prompt, kw) in enumerate(_requests(seed)):
        engine.add_request(f"r{i}", prompt, SamplingParams(output_kind=kind, **kw))
    seen: dict[str, list] = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    assert not engine.has_unfinished_requests()
    assert_no_leaks(llm)
    return seen


def _joined(outputs) -> dict[int, dict]:
    """DELTA outputs of one request, concatenated per sample."""
    joined: dict[int, dict] = {}
    for out in outputs:
        for c in out.outputs:
            j = joined.setdefault(c.index, {"ids": [], "text": "", "lps": [], "hidden": [],
                                            "finish": None})
            assert j["finish"] is None, "a sample spoke after its finish"
            j["ids"] += c.token_ids
            j["text"] += c.text
            j["lps"] += c.logprobs or []
            if c.hidden_states is not None:
                j["hidden"].append(c.hidden_states[1])
            j["finish"] = c.finish_reason
    return joined


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_delta_outputs_join_to_the_cumulative_output(tiny_llm, seed):
    want = _run(tiny_llm, CUMULATIVE, seed)
    got = _run(tiny_llm, DELTA, seed)
    assert want.keys() == got.keys()
    for rid, outs in want.items():
        final = outs[-1]
        assert final.finished and got[rid][-1].finished
        assert sum(o.finished for o in got[rid]) == 1
        joined = _joined(got[rid])
        assert sorted(joined) == [c.index for c in final.outputs]
        for c in final.outputs:
            j = joined[c.index]
            assert j["ids"] == c.token_ids and j["finish"] == c.finish_reason
            assert j["text"] == c.text
            assert j["lps"] == (c.logprobs or [])
            if c.hidden_states is not None:
                np.testing.assert_array_equal(np.concatenate(j["hidden"]), c.hidden_states[1])
        # prompt logprobs come once, with the first DELTA output
        firsts = [o.prompt_logprobs for o in got[rid]]
        assert firsts[0] == final.prompt_logprobs and all(p is None for p in firsts[1:])
    # a DELTA output holds only news: no sample repeats a token it already sent
    assert max(len(c.token_ids) for outs in got.values() for o in outs[:-1] for c in o.outputs) <= 1


def test_final_only_says_nothing_until_the_end(tiny_llm):
    want = _run(tiny_llm, CUMULATIVE, 2)
    got = _run(tiny_llm, FINAL_ONLY, 2)
    for rid, outs in got.items():
        assert len(outs) == 1 and outs[0].finished
        assert ([(c.token_ids, c.text, c.finish_reason) for c in outs[0].outputs]
                == [(c.token_ids, c.text, c.finish_reason) for c in want[rid][-1].outputs])


def test_an_aborted_delta_request_ends_with_abort(tiny_llm):
    engine = tiny_llm.llm_engine
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(output_kind=DELTA, max_tokens=50,
                                                          ignore_eos=True, temperature=0.0))
    sent = []
    for _ in range(4):
        for out in engine.step():
            sent.extend(out.outputs)
    engine.abort_request("a")
    final = [o for o in engine.step() if o.request_id == "a"]
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs and final[0].outputs[-1].finish_reason == "abort"
    assert all(c.finish_reason is None for c in sent)
    assert not engine.has_unfinished_requests()
    assert_no_leaks(tiny_llm)


def test_output_kind_is_checked_by_name():
    with pytest.raises(TypeError, match="output_kind"):
        SamplingParams(output_kind=1)
    with pytest.raises(ValueError, match="output_kind DELTA"):
        SamplingParams(output_kind=DELTA, n=1, best_of=2)
    assert SamplingParams(output_kind=FINAL_ONLY, n=1, best_of=2).best_of == 2
