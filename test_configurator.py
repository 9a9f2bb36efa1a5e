"""
Tests for configurator.py: the override mechanism and the rules every config key must satisfy.

$ python -m pytest test_configurator.py -q
"""
import math

import pytest
from hypothesis import given, strategies as st

import configurator as C


def test_int_rule_boundaries():
    r = C.Int(1, 8)
    assert [r.problem(v) is None for v in (0, 1, 8, 9)] == [False, True, True, False]
    assert r.problem(True) is not None, 'a bool is not an int here'
    assert r.problem(2.0) is not None, 'a float is not an int here'


@given(st.integers(-10**12, 10**12), st.integers(-50, 50), st.integers(0, 100))
def test_int_rule_is_the_interval(v, lo, width):
    assert (C.Int(lo, lo + width).problem(v) is None) == (lo <= v <= lo + width)


@given(st.floats(allow_nan=True, allow_infinity=True), st.floats(-10, 10), st.booleans())
def test_float_rule_is_finite_and_in_range(v, lo, lo_open):
    ok = C.Float(lo, lo_open=lo_open).problem(v) is None
    assert ok == (math.isfinite(v) and (v > lo if lo_open else v >= lo))


def test_choice_text_flag():
    assert C.Choice('a', 'b').problem('c') == "one of 'a', 'b'"
    assert C.Choice('', 'x').problem('') is None
    assert C.Flag().problem(1) is not None and C.Flag().problem(False) is None
    assert C.Text(r'cpu|cuda(:\d+)?').problem('cuda:1') is None
    assert C.Text(r'cpu|cuda(:\d+)?').problem('gpu') is not None


def test_check_names_key_value_and_what_is_allowed():
    with pytest.raises(C.ConfigError, match=r"^batch_size=0: must be an int >= 1$"):
        C.check(dict(batch_size=0), dict(batch_size=C.Int(1)))


def test_a_key_without_a_rule_is_a_bug_of_the_table():
    with pytest.raises(RuntimeError, match='without a rule.*new_key'):
        C.check(dict(batch_size=1, new_key=3), dict(batch_size=C.Int(1)))


def test_type_mismatch_from_the_command_line():
    with pytest.raises(C.ConfigError, match="'learning_rate'.*wants a float, got 'nan'"):
        C.configure(dict(learning_rate=1e-3), ['--learning_rate=nan'])
    assert C.configure(dict(learning_rate=1e-3), ['--learning_rate=1']) == dict(learning_rate=1.0)
