import pytest

from lightning_llm.metrics import wilson_interval


def test_wilson_interval_matches_known_values():
    low, high = wilson_interval(81, 100)  # Wilson 95% for 81/100: [0.7222, 0.8749]
    assert low == pytest.approx(0.7222, abs=1e-4) and high == pytest.approx(0.8749, abs=1e-4)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="n >= 1"):
        wilson_interval(0, 0)
