"""
checkpoint.py: writing, reading and resuming train.py's checkpoints. train.py writes them;
sample.py and export_hf.py read them; none of them imports another for it.

A run's folder holds the newest checkpoint as ckpt.pt and the older ones it keeps as
ckpt.<step>.pt. A checkpoint is a dict: model (state dict), model_args, recipe, optimizer
(state dict), optimizer_class, iter_num, config, rng (each rank's RNG states), history (the
loss curves), data (the sampler's position) and meta (the corpus's meta.json).

Every way a checkpoint cannot be used ends in one line that names the file and says what to do.
"""
import json
import os
import random
import time

import numpy as np
import torch

from model import RECIPES

# ---------------------------------------------------------------------------------------------
# file names: the newest is out_dir/ckpt.pt, older ones ckpt.<step>.pt

RESUME_KEYS = ('optimizer', 'iter_num', 'rng', 'history')  # what resuming needs beyond the model


def path_of(out_dir, step=None):
    return os.path.join(out_dir, 'ckpt.pt' if step is None else f'ckpt.{step}.pt')


def step_of(path):
    """The step in an older checkpoint's name, ckpt.<step>.pt; None for any other name."""
    parts = os.path.basename(path).split('.')
    ok = len(parts) == 3 and parts[0] == 'ckpt' and parts[1].isdigit() and parts[2] == 'pt'
    return int(parts[1]) if ok else None


def older(out_dir):
    """[(step, path)] of the kept older checkpoints, newest first."""
    names = os.listdir(out_dir) if os.path.isdir(out_dir) else []
    return sorted(((step_of(fn), os.path.join(out_dir, fn)) for fn in names
                   if step_of(fn) is not None), reverse=True)

# ---------------------------------------------------------------------------------------------
# writing: atomic, keeping the newest N


def save(state, out_dir, keep, prev_step, log=print):
    """Write state to a temp file, fsync it, then rename it to ckpt.pt: a crash or a kill at
    any moment leaves the last good checkpoint. The ckpt.pt it replaces, of this run's step
    prev_step, is kept as ckpt.<prev_step>.pt when keep > 1. A failed write (disk full,
    permissions) stops the run and leaves the earlier files as they were."""
    path, step = path_of(out_dir), state['iter_num']
    tmp = path + '.tmp'
    try:
        with open(tmp, 'wb') as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        if os.environ.get('TRAIN_TEST_SLOW_SAVE') == str(step):  # tests: a kill mid-save
            log(f'test hook: {tmp} written, sleeping before the rename')
            time.sleep(600)
        if keep > 1 and prev_step is not None and os.path.exists(path):
            os.replace(path, path_of(out_dir, prev_step))
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch.save raises OSError for a file object
        if os.path.lexists(tmp):
            os.remove(tmp)
        kept = path if os.path.exists(path) else 'none'
        raise SystemExit(f'could not write the checkpoint of step {step} to {tmp}: {e}. The run '
                         f'stopped; the last good checkpoint ({kept}) is as it was. Free space or '
                         f'fix permissions in {out_dir}, then continue with --resume=True')


def prune(out_dir, step, keep, earlier_run):
    """Keep the newest keep - 1 older files. Drop those of an abandoned later history (steps >=
    step, after resuming from an older one), and at a fresh run's first save those an earlier
    run in out_dir left."""
    old = older(out_dir)
    kept = [p for s, p in old if s < step and not earlier_run][:keep - 1]
    for _, p in old:
        if p not in kept:
            os.remove(p)

# ---------------------------------------------------------------------------------------------
# reading: one clear line for each way a checkpoint cannot be used


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used; the message names it and says why."""


def read(path):
    """torch.load, refusing a missing, unreadable (truncated, corrupt) or foreign file with a
    CheckpointError. Keys it does not know (other versions add some) are kept, not refused."""
    if not os.path.isfile(path):
        raise CheckpointError(f'{path} not found')
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=False)
    except Exception as e:  # torch raises many types for a truncated zip or a bad pickle
        reason = (str(e).strip().splitlines() or [''])[0].split('. ')[0][:160]
        raise CheckpointError(f'{path} is unreadable: truncated or corrupt ({type(e).__name__}: {reason})')
    missing = [k for k in ('model', 'model_args') if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise CheckpointError(f"{path} is not a train.py checkpoint: no {', '.join(missing)}")
    return ckpt


def recipe_of(ckpt, path):
    """The recipe a checkpoint was trained with, which must be one this code knows."""
    if 'recipe' not in ckpt:
        raise CheckpointError(f"{path} does not say which recipe trained it (no 'recipe' key), "
                              f"and the FP4 layers depend on it: add it, e.g. ckpt['recipe'] = "
                              f"'quartet', and save the checkpoint again")
    if ckpt['recipe'] not in RECIPES:
        raise CheckpointError(f"{path} was trained with recipe {ckpt['recipe']!r}, which this code "
                              f"does not know (it knows {', '.join(RECIPES)}): use the version "
                              f"of the code that trained it")
    return ckpt['recipe']


def meta_of(ckpt):
    """The corpus's meta.json (vocabulary, tokenizer), as the checkpoint holds it; older checkpoints:
    from the data folder their config names, if it is still there."""
    if 'meta' in ckpt:
        return ckpt['meta']
    cfg = ckpt.get('config', {})
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(cfg.get('data_dir') or os.path.join(here, 'data', cfg.get('dataset', '')),
                        'meta.json')
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {}


def load_model_state(model, ckpt, path):
    try:
        model.load_state_dict(ckpt['model'])
    except RuntimeError as e:  # missing or unexpected keys, or other shapes
        raise SystemExit(f"{path}: its weights do not fit the model built from its model_args and "
                         f"recipe {ckpt['recipe']!r} ({' '.join(str(e).split())[:300]}): it was "
                         f"written by another version of the code")

# ---------------------------------------------------------------------------------------------
# resuming


def resume_candidates(out_dir, resume_from):
    """(path, older): the checkpoint to continue from (resume_from, else out_dir/ckpt.pt) and
    the older ones to offer if it cannot be used. Nothing at all to resume stops the run."""
    path = resume_from or path_of(out_dir)
    newest = os.path.abspath(path) == os.path.abspath(path_of(out_dir))
    step = step_of(path)  # an older one: offer only those older still
    offer = [p for s, p in older(out_dir) if newest or step is not None and s < step]
    if not os.path.exists(path) and not resume_from and not offer:
        raise SystemExit(f'--resume=True: nothing to resume from, {path} not found: start a fresh '
                         f'run without --resume, or set --out_dir to the folder of the run')
    return path, offer


def read_for_resume(out_dir, resume_from):
    """(checkpoint, path) to continue from. A file that cannot be used stops the run and names
    the newest older checkpoint to resume instead."""
    path, offer = resume_candidates(out_dir, resume_from)
    try:
        ckpt = read(path)
        missing = [k for k in RESUME_KEYS if k not in ckpt]
        if missing:
            raise CheckpointError(f"{path} cannot be resumed: no {', '.join(missing)}")
        recipe_of(ckpt, path)
    except CheckpointError as e:
        hint = (f'resume from the previous checkpoint with --resume_from={offer[0]}' if offer else
                f'no older checkpoint is kept in {out_dir}: start a fresh run without --resume')
        raise SystemExit(f'{e}; {hint}')
    return ckpt, path


def rng_states(cuda):
    """Every RNG a step draws from (Python, numpy, torch, this rank's GPU): a resumed run goes on
    with exactly the numbers the uninterrupted run would have drawn."""
    s = {'python': random.getstate(), 'numpy': np.random.get_state(), 'torch': torch.get_rng_state()}
    if cuda:
        s['cuda'] = torch.cuda.get_rng_state()  # this rank's device
    return s


def set_rng_states(s, cuda):
    random.setstate(s['python'])
    np.random.set_state(s['numpy'])
    torch.set_rng_state(s['torch'])
    if 'cuda' in s and cuda:
        torch.cuda.set_rng_state(s['cuda'])


def optimizer_class(optimizer):
    return f'{type(optimizer).__module__}.{type(optimizer).__qualname__}'


def load_optimizer_state(model, optimizer, ckpt, path):
    """The optimizer state, refused if it belongs to another optimizer: torch's load_state_dict
    checks only the parameter counts, and a foreign state would then fail (or worse, not fail)
    in the first step. One written by FSDP2 (keyed by name) is loaded by name, each rank keeping
    its rows of every state (whether this run uses FSDP or not)."""
    saved, ours = ckpt.get('optimizer_class'), optimizer_class(optimizer)
    if saved is not None and saved != ours:
        raise SystemExit(f'{path} holds the state of a {saved} optimizer, but this run builds '
                         f'{ours}: resume with the optimizer it was trained with, or give a new '
                         f'--out_dir for a new run')
    try:
        if ckpt['config'].get('fsdp', False):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
            parts = getattr(optimizer, 'parts', optimizer)  # the torch optimizers of optim.Optimizers
            set_optimizer_state_dict(model, parts, ckpt['optimizer'],
                                     options=StateDictOptions(full_state_dict=True))
        else:
            optimizer.load_state_dict(ckpt['optimizer'])
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise SystemExit(f"{path}: its optimizer state does not fit this run's {ours} ({e}): "
                         f"resume with the optimizer it was trained with, or give a new --out_dir")
