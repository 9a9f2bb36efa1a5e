"""
checkpoint.py: writing, reading and resuming train.py's checkpoints. train.py writes them;
sample.py and export_hf.py read them; none of them imports another for it.

A run's folder holds the newest checkpoint as ckpt.pt and the older ones it keeps as
ckpt.<step>.pt. A checkpoint is a dict: model (state dict), model_args, recipe, optimizer
(state dict), optimizer_class, iter_num, config, rng (each rank's RNG states), history (the
loss curves; history['bf16_from']: the step from which the block linears ran BF16 under
fp4_until, absent while they run FP4), data (the sampler's position) and meta (the corpus's meta.json).

An FSDP2 run (--fsdp=True) writes the same dict as a folder, ckpt.dcp (older: ckpt.<step>.dcp),
with torch.distributed.checkpoint (DCP): every rank writes its shards of the weights and optimizer
states (packed FP4 states stay packed), no rank gathers the whole. It resumes at any world size
(DCP reshards), and sample.py and export_hf.py read it as they read ckpt.pt. One file:
python -m torch.distributed.checkpoint.format_utils dcp_to_torch out/ckpt.dcp out/ckpt.pt

Every way a checkpoint cannot be used ends in one line that names the file and says what to do.
"""
import json
import os
import random
import shutil
import time
import warnings

import numpy as np
import torch

from model import RECIPES, fp4_switch_step

# ---------------------------------------------------------------------------------------------
# file names: the newest is out_dir/ckpt.pt (a file) or out_dir/ckpt.dcp (FSDP2's folder), older
# ones ckpt.<step>.pt or ckpt.<step>.dcp

RESUME_KEYS = ('optimizer', 'iter_num', 'rng', 'history')  # what resuming needs beyond the model
KINDS = ('pt', 'dcp')  # one file (torch.save), a folder of shards (DCP)


def path_of(out_dir, step=None, sharded=False):
    kind = 'dcp' if sharded else 'pt'
    return os.path.join(out_dir, f'ckpt.{kind}' if step is None else f'ckpt.{step}.{kind}')


def newest(out_dir):
    """The newest checkpoint's path: ckpt.dcp where an FSDP2 run wrote one, else ckpt.pt (which
    may not exist yet)."""
    sharded = path_of(out_dir, sharded=True)
    return sharded if os.path.isdir(sharded) else path_of(out_dir)


def is_sharded(path):
    """Whether path is a sharded checkpoint (a DCP folder), not one file."""
    return os.path.isdir(path)


def step_of(path):
    """The step in an older checkpoint's name, ckpt.<step>.pt or .dcp; None for any other name."""
    parts = os.path.basename(path).split('.')
    ok = len(parts) == 3 and parts[0] == 'ckpt' and parts[1].isdigit() and parts[2] in KINDS
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
        _install(tmp, path, out_dir, keep, prev_step)
    except (OSError, RuntimeError) as e:  # torch.save raises OSError for a file object
        _remove(tmp)
        raise SystemExit(_write_failed(step, tmp, out_dir, e))


def _write_failed(step, tmp, out_dir, reason):
    kept = newest(out_dir) if os.path.exists(newest(out_dir)) else 'none'
    return (f'could not write the checkpoint of step {step} to {tmp}: {reason}. The run stopped; the '
            f'last good checkpoint ({kept}) is as it was. Free space or fix permissions in {out_dir}, '
            f'then continue with --resume=True')


def _install(tmp, path, out_dir, keep, prev_step):
    """Rename the finished tmp (file or folder) to path, the newest checkpoint. The newest it
    replaces (of either kind) is this run's previous save or the checkpoint it resumed, of step
    prev_step: kept as ckpt.<prev_step>.<kind> when keep > 1. Otherwise a file of the same name is
    replaced by the (atomic) rename, anything else removed once the new one is in place."""
    gone = []
    for old in (path_of(out_dir), path_of(out_dir, sharded=True)):
        if not os.path.lexists(old):
            continue
        if keep > 1 and prev_step is not None:
            os.replace(old, path_of(out_dir, prev_step, sharded=is_sharded(old)))
        elif old != path or is_sharded(old):  # a folder cannot be replaced by a rename
            _remove(old + '.old')
            os.replace(old, old + '.old')
            gone.append(old + '.old')
    os.replace(tmp, path)
    for old in gone:
        _remove(old)


def _remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def save_sharded(state, out_dir, keep, prev_step, log=print):
    """save() for FSDP2, on every rank: each writes its shards of the weights and optimizer states
    (DTensors) into the folder ckpt.dcp.tmp with torch.distributed.checkpoint, rank 0 the rest;
    then rank 0 renames it to ckpt.dcp (_install). A failed write on any rank stops every rank
    and leaves the earlier checkpoints as they were. log: save()'s (nothing to log here)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    path, step, rank0 = path_of(out_dir, sharded=True), state['iter_num'], dist.get_rank() == 0
    tmp = path + '.tmp'
    if rank0:
        _remove(tmp)  # what a killed write left
    dist.barrier()
    try:
        dcp.save(state, checkpoint_id=tmp)
        error = None
    except (Exception, dcp.CheckpointException) as e:  # DCP's holds every rank's failure
        error = _first_line(e)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)  # every rank stops if any rank's write failed
    outcome = [next((e for e in errors if e), None)]
    if rank0 and outcome[0] is None:
        try:
            _install(tmp, path, out_dir, keep, prev_step)
        except OSError as e:
            outcome[0] = _first_line(e)
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        if rank0:
            _remove(tmp)
        raise SystemExit(_write_failed(step, tmp, out_dir, outcome[0]))


def _first_line(e):
    failures = getattr(e, 'failures', None)  # CheckpointException: {rank: (exception, traceback)}
    if failures:
        rank, (exc, _) = next(iter(failures.items()))
        return f'rank {rank}: {type(exc).__name__}: {(str(exc).splitlines() or [""])[0][:200]}'
    return f'{type(e).__name__}: {(str(e).splitlines() or [""])[0][:200]}'


def state_dicts(model, optimizer, fsdp):
    """(model, optimizer) state dicts to save. With FSDP2 as this rank holds them, keyed by parameter
    name: DTensors of its rows (packed FP4 states too: optim.py), what save_sharded writes and the
    template load_sharded reads into (a collective: every rank calls it)."""
    if not fsdp:
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    return get_model_state_dict(model), get_optimizer_state_dict(model, getattr(optimizer, 'parts', optimizer))


def to_one_file(path):
    """The command that converts a sharded checkpoint to one torch.save file (torch's converter)."""
    return f'python -m torch.distributed.checkpoint.format_utils dcp_to_torch {path} <another out_dir>/ckpt.pt'


def prune(out_dir, step, keep, earlier_run):
    """Keep the newest keep - 1 older files. Drop those of an abandoned later history (steps >=
    step, after resuming from an older one), and at a fresh run's first save those an earlier
    run in out_dir left."""
    old = older(out_dir)
    kept = [p for s, p in old if s < step and not earlier_run][:keep - 1]
    for _, p in old:
        if p not in kept:
            _remove(p)

# ---------------------------------------------------------------------------------------------
# reading: one clear line for each way a checkpoint cannot be used


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used; the message names it and says why."""


IN_SHARDS = 'in the shards of a sharded checkpoint'  # an entry read_for_resume leaves for load_sharded


def read(path, skip=('optimizer',)):
    """torch.load, refusing a missing, unreadable (truncated, corrupt) or foreign file with a
    CheckpointError. Keys it does not know (other versions add some) are kept, not refused.
    A sharded checkpoint (a DCP folder) is read whole into this process, as plain tensors, but for
    its `skip` entries (left IN_SHARDS): by default the optimizer states, which sampling and export
    do not need."""
    if not os.path.exists(path):
        raise CheckpointError(f'{path} not found')
    try:
        ckpt = _read_sharded(path, skip) if is_sharded(path) else torch.load(path, map_location='cpu', weights_only=False)
    except Exception as e:  # torch raises many types for a truncated zip or a bad pickle
        reason = (str(e).strip().splitlines() or [''])[0].split('. ')[0][:160]
        raise CheckpointError(f'{path} is unreadable: truncated or corrupt ({type(e).__name__}: {reason})')
    missing = [k for k in ('model', 'model_args') if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise CheckpointError(f"{path} is not a train.py checkpoint: no {', '.join(missing)}")
    return ckpt


def _read_sharded(path, skip):
    """A DCP folder's entries but `skip`, as plain tensors in this process (torch's loader by keys,
    which dcp_to_torch_save uses too)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    meta = FileSystemReader(path).read_metadata()
    stored = {p[0] for p in meta.planner_data.values()}  # the top-level keys
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter('ignore')
        ckpt = _load_state_dict_from_keys(stored - set(skip), checkpoint_id=path)
    return {**ckpt, **{k: IN_SHARDS for k in stored & set(skip)}}


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
    if ckpt['model'] is IN_SHARDS:
        return  # read with the optimizer state into the sharded model (load_optimizer_state)
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
    path = resume_from or newest(out_dir)
    is_newest = os.path.abspath(path) == os.path.abspath(newest(out_dir))
    step = step_of(path)  # an older one: offer only those older still
    offer = [p for s, p in older(out_dir) if is_newest or step is not None and s < step]
    if not os.path.exists(path) and not resume_from and not offer:
        raise SystemExit(f'--resume=True: nothing to resume from, {path} not found: start a fresh '
                         f'run without --resume, or set --out_dir to the folder of the run')
    return path, offer


def read_for_resume(out_dir, resume_from):
    """(checkpoint, path) to continue from. A file that cannot be used stops the run and names
    the newest older checkpoint to resume instead."""
    path, offer = resume_candidates(out_dir, resume_from)
    try:
        ckpt = read(path, skip=('model', 'optimizer'))  # a sharded one: each rank reads its rows later
        missing = [k for k in RESUME_KEYS if k not in ckpt]
        if missing:
            raise CheckpointError(f"{path} cannot be resumed: no {', '.join(missing)}")
        recipe_of(ckpt, path)
    except CheckpointError as e:
        hint = (f'resume from the previous checkpoint with --resume_from={offer[0]}' if offer else
                f'no older checkpoint is kept in {out_dir}: start a fresh run without --resume')
        raise SystemExit(f'{e}; {hint}')
    return ckpt, path


def bf16_from(ckpt, path, fp4_until, max_iters):
    """The step from which the checkpoint's block linears ran BF16 (train.py's fp4_until), None
    while they ran FP4: a run resumed after the switch stays BF16. Refused in one line where this
    run's switch step, round(fp4_until * max_iters), contradicts what the checkpoint trained: FP4
    past it, or BF16 from another step. A switch still ahead may move (study.py branches there)."""
    it, since, s = ckpt['iter_num'], ckpt['history'].get('bf16_from'), fp4_switch_step(fp4_until, max_iters)
    if since is None and it > s:
        raise SystemExit(f'{path} ran FP4 GEMMs through step {it - 1}, past step {s} where fp4_until={fp4_until} '
                         f'switches to BF16 (of max_iters={max_iters}): resume it with a later switch, '
                         f'fp4_until >= {it / max_iters:.6g}')
    if since is not None and since != s:
        raise SystemExit(f'{path} switched the block linears to BF16 at step {since}, but fp4_until={fp4_until} '
                         f'switches at step {s} (of max_iters={max_iters}): a resumed run keeps its switch; '
                         f'give the fp4_until of step {since}, e.g. --fp4_until={since / max_iters:.6g}')
    return since


def at_step(out_dir, step):
    """The path of out_dir's kept checkpoint of `step` (ckpt.<step>.pt, or ckpt.pt if it is that
    step's), or None: where study.py branches a BF16 tail from an FP4 run. Reads only iter_num."""
    if os.path.exists(path_of(out_dir, step)):
        return path_of(out_dir, step)
    try:
        newest_step = torch.load(path_of(out_dir), map_location='cpu', weights_only=False, mmap=True)['iter_num']
    except Exception:  # missing, or unreadable: no checkpoint of that step here
        return None
    return path_of(out_dir) if newest_step == step else None


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
    its rows of every state (whether this run uses FSDP or not); a sharded one (read_for_resume
    left it IN_SHARDS) together with the weights, each rank reading its rows (load_sharded)."""
    saved, ours = ckpt.get('optimizer_class'), optimizer_class(optimizer)
    if saved is not None and saved != ours:
        raise SystemExit(f'{path} holds the state of a {saved} optimizer, but this run builds '
                         f'{ours}: resume with the optimizer it was trained with, or give a new '
                         f'--out_dir for a new run')
    try:
        if ckpt['optimizer'] is IN_SHARDS:
            load_sharded(model, optimizer, path)
        elif ckpt['config'].get('fsdp', False):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
            parts = getattr(optimizer, 'parts', optimizer)  # the torch optimizers of muon.Optimizers
            set_optimizer_state_dict(model, parts, ckpt['optimizer'],
                                     options=StateDictOptions(full_state_dict=True))
        else:
            optimizer.load_state_dict(ckpt['optimizer'])
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise SystemExit(f"{path}: its optimizer state does not fit this run's {ours} ({e}): "
                         f"resume with the optimizer it was trained with, or give a new --out_dir")


def load_sharded(model, optimizer, path):
    """The weights and optimizer states of a sharded checkpoint into this run's FSDP2 model and
    optimizer: each rank reads the rows it holds, at any world size (DCP reshards the saved rows;
    packed FP4 states are whole rows, so they move as they are)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    model_state, optimizer_state = state_dicts(model, optimizer, fsdp=True)
    state = dict(model=model_state, optimizer=optimizer_state)
    try:
        dcp.load(state, checkpoint_id=path)
    except dcp.CheckpointException as e:  # a BaseException, one per rank: e.g. a state this run's optimizer lacks
        raise ValueError(_first_line(e))
    set_model_state_dict(model, state['model'])
    set_optimizer_state_dict(model, getattr(optimizer, 'parts', optimizer), state['optimizer'])
