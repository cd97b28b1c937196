"""OpenForecaster's reward: parsing, values, properness."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_llm.datamodules.tasks import Example
from lightning_llm.rewards import (
    forecasting_brier_reward,
    forecasting_reward,
    forecasting_score,
    get_reward,
    parse_forecast,
)


def forecast(answer: str, q: float) -> str:
    return f"<answer>{answer}</answer><probability>{q}</probability>"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer>Tamur</answer><probability>0.7</probability>", ("Tamur", 0.7)),
        ("<think>x</think><answer> Tamur </answer> \n<probability> 1 </probability>", ("Tamur", 1.0)),
        (
            "<answer>A</answer><probability>0.2</probability><answer>B</answer><probability>.5</probability>",
            ("B", 0.5),
        ),
        ("<answer>A</answer><probability>0.2</probability><answer>B</answer>", None),  # last answer has no q
        ("<answer>A</answer><probability>1.5</probability>", None),
        ("<answer>A</answer><probability>70%</probability>", None),
        ("<answer>A</answer><probability>1e-1</probability>", None),
        ("<answer> </answer><probability>0.5</probability>", None),
        ("<answer>A</answer>", None),
        ("", None),
    ],
)
def test_parse_forecast(text, expected):
    assert parse_forecast(text) == expected


@given(st.text())
def test_parse_never_raises_and_q_in_unit_interval(text):
    parsed = parse_forecast(text)
    assert parsed is None or (0.0 <= parsed[1] <= 1.0 and parsed[0])
    assert forecasting_score(text, "x") >= -1.0


@given(st.text(alphabet="<>/answerpobilty0.1 ", max_size=60))
def test_parse_never_raises_on_tag_soup(text):
    parse_forecast(text)


def test_values():
    assert forecasting_score(forecast("Tamur", 0.8), "tamur") == pytest.approx(1 + 1 - 0.2**2)
    assert forecasting_score(forecast("Velo", 0.8), "Tamur") == pytest.approx(-0.64)
    assert forecasting_score(forecast("The Tamur.", 0.5), "tamur", accuracy=False) == pytest.approx(0.75)
    assert forecasting_score("no forecast", "Tamur") == -1.0
    assert forecasting_score("no forecast", "Tamur", accuracy=False) == -1.0
    # Binary: q is the confidence in the stated yes/no answer; R = -(p_yes - o)^2.
    assert forecasting_score(forecast("yes", 0.7), "yes", outcome=1) == pytest.approx(-0.09)
    assert forecasting_score(forecast("no", 0.7), "yes", outcome=1) == pytest.approx(-0.49)
    assert forecasting_score(forecast("no", 0.9), "no", outcome=0) == pytest.approx(-0.01)
    assert forecasting_score(forecast("maybe", 0.9), "no", outcome=0) == -1.0


def test_registered_rewards_read_answer_and_outcome():
    examples = [Example("q", "", "Tamur"), Example("q", "", "yes", {"outcome": 1})]
    texts = [forecast("Tamur", 1.0), forecast("yes", 1.0)]
    assert get_reward("forecasting") is forecasting_reward
    assert forecasting_reward(texts, examples) == [2.0, 0.0]
    assert get_reward("forecasting_brier") is forecasting_brier_reward
    assert forecasting_brier_reward(texts, examples) == [1.0, 0.0]
    with pytest.raises(ValueError, match="outcome"):
        forecasting_reward(texts[:1], [Example("q", "", "x", {"outcome": 0.5})])


GRID = [i / 100 for i in range(101)]


def expected(p: float, q: float, accuracy: bool) -> float:
    return p * forecasting_score(forecast("A", q), "A", accuracy=accuracy) + (1 - p) * forecasting_score(
        forecast("A", q), "B", accuracy=accuracy
    )


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 100), st.booleans())
def test_free_form_score_is_proper(p_percent, accuracy):
    """For an answer right with probability p, the expected reward over stated q peaks at q = p."""
    p = p_percent / 100
    best = max(GRID, key=lambda q: expected(p, q, accuracy))
    assert best == pytest.approx(p)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 100), st.sampled_from(["yes", "no"]))
def test_binary_score_is_proper(p_percent, said):
    """Event with probability p: the expected reward peaks where the implied P(yes) equals p."""
    p = p_percent / 100

    def value(q: float) -> float:
        text = forecast(said, q)
        return p * forecasting_score(text, "yes", outcome=1) + (1 - p) * forecasting_score(
            text, "no", outcome=0
        )

    best = max(GRID, key=value)
    assert (best if said == "yes" else 1 - best) == pytest.approx(p)
