"""The prose needle prompts of ``datamodules/needle.py``: their depths and the first-number scorer."""

from __future__ import annotations

from lightning_llm.datamodules.needle import DEPTHS, first_number_score, nearest_depth, needle_examples
from lightning_llm.types import Example


def test_first_number_score_reads_the_first_number_only():
    ex = Example(prompt="p", completion="<answer>0487</answer>", answer="0487")
    assert first_number_score("The code for sample is 0487.", ex) == 1.0
    assert first_number_score("0487", ex) == 1.0
    assert first_number_score("The code for sample is 048.", ex) == 0.0
    assert first_number_score("It is 12, not 0487", ex) == 0.0
    assert first_number_score("The code for sample is:", ex) == 0.0


def test_needle_examples_spread_over_the_depths_and_are_seeded():
    examples = needle_examples("needle", 10, 380, seed=3)
    assert [nearest_depth(ex) for ex in examples] == [d for d in DEPTHS for _ in range(2)]
    assert [ex.prompt for ex in needle_examples("needle", 10, 380, seed=3)] == [ex.prompt for ex in examples]
    assert needle_examples("needle", 10, 380, seed=4)[0].prompt != examples[0].prompt
    multikey = needle_examples("multikey_needle", 3, 60, seed=0)
    assert len(multikey) == 3 and all(ex.prompt.count("The code for") >= 4 for ex in multikey)
