"""
nanoGPT's override mechanism, with checks. train.py keeps its settings as module
globals; this turns the command line into a dict of new values for them:

$ python train.py config/quartet_30m.py --batch_size=32 --recipe=nvfp4

A bare argument (no '--') is a config file: Python that assigns some of the globals.
'--key=value' is parsed as a Python literal when it is one (32, 3e-4, True), else
taken as a string. A key that train.py does not have, or a value whose type differs
from the default's (an int where a float is expected is fine), raises ConfigError
naming the key, so a typo never runs silently with the default.
"""

import ast
import math
import os
import re
import types


class ConfigError(ValueError):
    pass


def _check(key, value, defaults, origin):
    if key not in defaults:
        raise ConfigError(f"unknown config key {key!r} (from {origin}); "
                          f"allowed keys: {', '.join(sorted(defaults))}")
    want = type(defaults[key])
    if want is float and type(value) is int:
        return float(value)  # --learning_rate=1 means 1.0
    if type(value) is not want:
        raise ConfigError(f"config key {key!r} (from {origin}) wants a {want.__name__}, "
                          f"got {value!r} ({type(value).__name__})")
    return value


def _parse_value(text, want):
    if want is str:
        return text  # strings need no quotes: --recipe=nvfp4
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # left as str; _check then names the type it wanted


def configure(defaults, argv):
    """Return {key: new value} for the keys that config files and --key=value set."""
    out = {}
    for arg in argv:
        if not arg.startswith('--'):
            if not os.path.isfile(arg):
                raise ConfigError(f'config file {arg!r} not found (bare arguments are config files)')
            scope = {}
            with open(arg) as f:
                exec(f.read(), scope)
            for key, value in scope.items():
                if not key.startswith('_') and not isinstance(value, types.ModuleType):
                    out[key] = _check(key, value, defaults, arg)
            continue
        key, sep, text = arg[2:].partition('=')
        if not sep:
            raise ConfigError(f'expected --key=value, got {arg!r}')
        if key in defaults:
            value = _parse_value(text, type(defaults[key]))
        else:
            value = text
        out[key] = _check(key, value, defaults, arg)
    return out


# -----------------------------------------------------------------------------
# rules: every key's type and allowed values, one table (train.RULES), checked before any data
# or model is loaded. A value outside its rule is a ConfigError naming the key, the value and
# what is allowed.

class Rule:
    """A key's allowed values: `kind` (int, float, bool or str) and a test with its words."""
    def __init__(self, kind, test=None, allowed=''):
        self.kind, self.test, self.allowed = kind, test, allowed or f'a {kind.__name__}'

    def problem(self, value):
        """None if value is allowed, else what is allowed."""
        if type(value) is not self.kind or (self.test is not None and not self.test(value)):
            return self.allowed
        return None


def Int(lo=None, hi=None, note=''):
    """An int in [lo, hi] (either end open when None)."""
    bounds = ' and '.join(s for s in (lo is not None and f'>= {lo}', hi is not None and f'<= {hi}') if s)
    return Rule(int, lambda v: (lo is None or v >= lo) and (hi is None or v <= hi),
                'an int' + (f' {bounds}' if bounds else '') + (f' ({note})' if note else ''))


def Float(lo=None, hi=None, lo_open=False, hi_open=False, note=''):
    """A finite float in the interval; an open end excludes the bound itself."""
    def test(v):
        return (math.isfinite(v) and (lo is None or (v > lo if lo_open else v >= lo))
                and (hi is None or (v < hi if hi_open else v <= hi)))
    ends = [f"{'>' if lo_open else '>='} {lo}" if lo is not None else '',
            f"{'<' if hi_open else '<='} {hi}" if hi is not None else '']
    bounds = ' and '.join(e for e in ends if e)
    return Rule(float, test, 'a finite float' + (f' {bounds}' if bounds else '') + (f' ({note})' if note else ''))


def Choice(*values):
    kind = type(values[-1])
    return Rule(kind, lambda v: v in values, 'one of ' + ', '.join(repr(v) for v in values))


def Flag():
    return Rule(bool, allowed='True or False')


def Text(pattern=None, note=''):
    """A string; with a pattern, one that matches it whole."""
    test = (lambda v: re.fullmatch(pattern, v) is not None) if pattern else None
    return Rule(str, test, note or 'a string')


def check(config, rules):
    """Raise ConfigError for the first key whose value breaks its rule. A key without a rule is
    a bug of the table, not of the config: every key must have one."""
    unruled = sorted(set(config) - set(rules))
    if unruled:
        raise RuntimeError(f"config keys without a rule in the table: {', '.join(unruled)}")
    for key, rule in rules.items():
        if key in config:
            allowed = rule.problem(config[key])
            if allowed is not None:
                raise ConfigError(f'{key}={config[key]!r}: must be {allowed}')
