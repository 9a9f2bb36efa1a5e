"""
Tests for C.py: the override mechanism and the rules every config key must satisfy,
and train.py's table of them (train.RULES): each value a user can type either trains one tiny step
or stops with one line.

$ python -m pytest test_configurator.py -q
"""
import math
import os
import subprocess
import sys

import hypothesis as hyp
import pytest
from hypothesis import given, strategies as st

import configurator as C
import train
from test_train import write_corpus


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


# -----------------------------------------------------------------------------
# every config value: a tiny step or one clear line (configurator rules, train.RULES)


def test_every_key_has_a_rule_and_the_defaults_keep_it():
    assert set(train.RULES) == set(train.DEFAULTS)
    C.check(train.DEFAULTS, train.RULES)


@pytest.mark.parametrize('key', sorted(train.RULES))
def test_a_value_outside_each_rule_is_refused_naming_the_key(key):
    """Each key's rule rejects a wrong type, and its boundary's outside where it has one."""
    rule, default = train.RULES[key], train.DEFAULTS[key]
    bad = [None, [default]] + ([-10**9] if rule.kind is int and rule.problem(-10**9) else [])
    bad += [math.nan] if rule.kind is float else []
    bad += ['\x00'] if rule.kind is str and rule.problem('\x00') else []
    for value in bad:
        with pytest.raises(C.ConfigError, match=f'^{key}='):
            C.check(dict(train.DEFAULTS, **{key: value}), train.RULES)


@pytest.mark.parametrize('flag', ['--batch_size=0', '--eval_interval=0', '--seed=-1', '--max_iters=-5',
                                  '--eval_iters=0'])
def test_bad_values_stop_before_any_work(tmp_path, flag):
    """The values that once reached a traceback or a run that claimed success: one line, nothing written."""
    with pytest.raises(C.ConfigError) as e:
        train.main([f'--out_dir={tmp_path}/out', '--device=cpu', flag])
    assert flag[2:].split('=')[0] in str(e.value) and '\n' not in str(e.value)
    assert not (tmp_path / 'out').exists()


def test_bad_value_from_the_command_line_is_one_line_and_nonzero(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), 'train.py'), '--batch_size=0',
                        f'--out_dir={tmp_path}'], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and p.stdout == ''
    assert p.stderr == 'config error: batch_size=0: must be an int >= 1\n', p.stderr


FUZZ_EXPENSIVE = {('compile', True), ('data_dir', '')}  # a compile on the CPU; preparing data/pycode


def fuzz_values(key):
    """Values of every type, with the rule's edges: ints around its bounds, floats' non-finite
    ones, its choices (model sizes past 2m are too big for a test step), random text."""
    rule = train.RULES[key]
    choices = []
    for v in ('tiny', 'bf16', 'quartet', 'nvfp4', 'fullstack', 'float8', 'adamw_fp4', 'root_fp4', 'muon',
              'nvfp4x2', 'mlp', 'fp4', 'bf16', '', 'cpu', 'cuda', 'default', 'max-autotune', 'float32'):
        if rule.kind is str and rule.problem(v) is None:
            choices.append(v)
    return st.one_of(st.integers(-3, 6), st.sampled_from([2**32, -2**31, 33, 40]),
                     st.sampled_from([0.0, -0.5, 0.5, 0.99, 1.0, 1.5, 1e-9, math.inf, -math.inf, math.nan]),
                     st.booleans(), st.none(), st.text(max_size=6), st.sampled_from(choices or ['x']))


@hyp.settings(max_examples=10, deadline=None, suppress_health_check=list(hyp.HealthCheck), derandomize=True)
@hyp.given(st.data())
def test_config_fuzz_runs_or_says_one_line(tmp_path_factory, data):
    """A random key set to a random value: the run trains its one tiny step and writes a finite
    summary, or stops with one line (a ConfigError naming the key, or a SystemExit), never a traceback."""
    key = data.draw(st.sampled_from(sorted(train.RULES)), label='key')
    value = data.draw(fuzz_values(key), label='value')
    hyp.assume((key, value) not in FUZZ_EXPENSIVE and not (key == 'model_size' and value not in ('tiny',)))
    tmp = tmp_path_factory.mktemp('fuzz')
    write_corpus(str(tmp), n=4000)
    flag = f'--{key}={value}' if isinstance(value, str) else f'--{key}={value!r}'
    argv = [f'--data_dir={tmp}', f'--out_dir={tmp}/out', '--model_size=tiny', '--block_size=32', '--batch_size=1',
            '--max_iters=1', '--eval_interval=1', '--eval_iters=1', '--sample_tokens=0', '--device=cpu',
            '--dtype=float32', '--compile=False', '--recipe=bf16', flag]
    cwd = os.getcwd()
    os.chdir(tmp)  # a random relative out_dir lands here
    try:
        summary = train.main(argv)
    except C.ConfigError as e:
        assert '\n' not in str(e) and key in str(e), f'{flag}: {e}'
        return
    except SystemExit as e:
        assert isinstance(e.code, str) and e.code and '\n' not in e.code.strip(), f'{flag}: {e.code!r}'
        return
    finally:
        os.chdir(cwd)
    if summary is not None:  # a stop signal is the other way to return: none is sent here
        assert math.isfinite(summary['val_loss']) and summary['iters'] >= 1, (flag, summary['val_loss'])
