"""``lightning_llm.text`` helpers without a better home in the test tree."""

import json
import math

import pytest

from lightning_llm.text import finite_json


def test_finite_json_nulls_every_non_finite_float_at_any_depth():
    value = {"a": math.nan, "b": [1.0, math.inf, (-math.inf, 2)], "c": {"d": 0.5, "e": "nan"}}
    assert finite_json(value) == {"a": None, "b": [1.0, None, [None, 2]], "c": {"d": 0.5, "e": "nan"}}
    json.dumps(finite_json(value), allow_nan=False)  # strict JSON now
    with pytest.raises(ValueError):
        json.dumps(value, allow_nan=False)
