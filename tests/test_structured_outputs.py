"""Structured outputs through llguidance: the grammar's mask is computed on the host per row
and applied on the device; sampled outputs always belong to the language."""
from __future__ import annotations

import json
import re

import pytest

from engine_helpers import assert_no_leaks
from paxkv import SamplingParams
from paxkv.sampling_params import StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "married": {"type": "boolean"},
        "children": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 1},
    },
    "required": ["name", "age", "married"],
    "additionalProperties": False,
}


@pytest.mark.slow
def test_json_schema_outputs_parse_and_validate(tiny_llm):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=80,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA))
              for s in range(50)]
    outs = tiny_llm.generate(["Describe a character as JSON:"] * 50, params, use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len({o.outputs[0].text for o in outs}) > 10      # sampled, not one forced string
    assert_no_leaks(tiny_llm)


def test_choice_outputs_are_one_of_the_choices(tiny_llm):
    choices = ["Elizabeth", "Mr. Darcy", "Jane", "Lady Catherine de Bourgh"]
    so = StructuredOutputsParams(choice=choices)
    outs = tiny_llm.generate(["Who is the proudest?"] * 8,
                        [SamplingParams(temperature=2.5, seed=s, n=2, max_tokens=30,
                                        structured_outputs=so) for s in range(8)], use_tqdm=False)
    texts = [c.text for o in outs for c in o.outputs]
    assert set(texts) <= set(choices) and len(set(texts)) > 1


def test_regex_and_grammar(tiny_llm):
    regex = StructuredOutputsParams(regex=r"[A-Z][a-z]{2,6} [0-9]{2}")
    lark = StructuredOutputsParams(grammar='start: "yes" | "no" | "perhaps, " word\nword: /[a-z]{1,8}/')
    outs = tiny_llm.generate(["Answer:"] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=30,
                                                       structured_outputs=regex if s % 2 else lark)
                                        for s in range(4)], use_tqdm=False)
    for s, o in enumerate(outs):
        text = o.outputs[0].text
        if s % 2:
            assert re.fullmatch(r"[A-Z][a-z]{2,6} [0-9]{2}", text), text
        else:
            assert re.fullmatch(r"yes|no|perhaps, [a-z]{1,8}", text), text


def test_structured_rows_do_not_disturb_the_others(tiny_llm):
    plain = [SamplingParams(temperature=0.9, seed=s, max_tokens=12, ignore_eos=True) for s in range(3)]
    so = SamplingParams(temperature=1.0, seed=4, max_tokens=60,
                        structured_outputs=StructuredOutputsParams(json=SCHEMA))
    prompts = ["She was", "Emma", "It is a truth", "JSON:"]
    solo = [tiny_llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
            for p, sp in zip(prompts, plain + [so])]
    mixed = tiny_llm.generate(prompts, plain + [so], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed] == solo


def test_structured_outputs_need_the_host_each_step():
    so = StructuredOutputsParams(choice=["a", "b"])
    assert SamplingParams(structured_outputs=so).needs_host_sync
    assert not SamplingParams(repetition_penalty=1.2, bad_words=["x"]).needs_host_sync
