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
import os
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
