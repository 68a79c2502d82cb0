"""The chat prompts the speculative-decoding experiments share (`spec_acceptance.py`,
`draft_acceptance.py`): four kinds, four prompts each. Editing code, correcting a paragraph
and extracting from a passage repeat much of the prompt in the answer; open questions do not.
"""
from __future__ import annotations

CODE = '''def total(xs):
    s = 0
    for x in xs:
        s = s + x
    return s


def mean(xs):
    return total(xs) / len(xs)
'''
PARAGRAPH = ("Their was a old house at the end of the street. Every morning the childs walked "
             "passed it on they way to school, and every evening they walk back again. Nobody "
             "know who lived their, but the garden were always full of flower.")
PASSAGE = ("Mr. Bennet was among the earliest of those who waited on Mr. Bingley. He had always "
           "intended to visit him, though to the last always assuring his wife that he should "
           "not go; and till the evening after the visit was paid she had no knowledge of it. "
           "Elizabeth, Jane and Lydia were in the room, and Mrs. Bennet spoke to Kitty.")

PROMPTS = {
    "edit code": [
        f"Rename the variable `s` to `acc` in this Python code. Reply with the full code.\n\n{CODE}",
        f"Add a docstring to each function of this code and reply with the whole code.\n\n{CODE}",
        f"Rewrite this code with type hints (list[float] -> float). Reply with the code.\n\n{CODE}",
        f"Rename the function `total` to `add_all` everywhere in this code.\n\n{CODE}",
    ],
    "correct text": [
        f"Correct the grammar and spelling of this paragraph:\n\n{PARAGRAPH}",
        f"Fix the mistakes in this text and return the corrected text:\n\n{PARAGRAPH}",
        f"Proofread this:\n\n{PARAGRAPH}",
        f"Rewrite this paragraph in correct English:\n\n{PARAGRAPH}",
    ],
    "extract": [
        f"List every person named in this passage, one per line:\n\n{PASSAGE}",
        f"Quote the sentence of this passage that mentions the evening:\n\n{PASSAGE}",
        f"Copy this passage and put each sentence on its own line:\n\n{PASSAGE}",
        f"Which people were in the room? Answer with their names from the passage.\n\n{PASSAGE}",
    ],
    "open question": [
        "What is the capital of France, and why is it famous?",
        "Give three tips for sleeping well.",
        "Explain what a hash table is to a beginner.",
        "Write a short poem about the sea.",
    ],
}
