"""
Accuracy study: how much loss each FP4 recipe costs against BF16, with error bars.
Same-token training runs over recipes x seeds x model sizes x token budgets, each one a
train.py subprocess on one GPU; then the gaps to BF16 paired by seed with 95% intervals,
loss curves with seed bands, and the Quartet-form scaling law with effN and effD per
recipe (SPEC.md 6).

$ python study/study.py plan --recipes=bf16,quartet,nvfp4,quartet2 --seeds=0,1,2 --sizes=30m --tokens=50e6
$ python study/study.py run  --recipes=bf16,quartet,nvfp4,quartet2 --seeds=0,1,2 --sizes=30m --tokens=50e6
$ python study/study.py run  --recipes=bf16,quartet --seeds=0,1,2 --sizes=30m --tokens=50e6 \\
      --variant=adamw_fp4 -- --optimizer=adamw_fp4    # a named variant: extra train.py flags
$ python study/study.py run  --recipes=bf16,quartet --seeds=0,1,2 --sizes=30m --tokens=50e6 \\
      --tails=0.1,0.2                                  # + quartet with BF16 over the last 10%, 20% of steps
$ python study/study.py report                               # results/<gpu>/study/report.md and PNGs

Each finished run is one JSON in results/<gpu>/study/; `run` skips the runs whose JSON is
there, so a study is completed in parts, and --budget_min starts only the runs that fit.
Seeds are paired: train.py's seed fixes the initial weights (apply_recipe keeps the BF16
model's Parameters), the training batches and the eval batches (get_batch is a function of
seed and step), so recipe R and bf16 at seed s differ only by the recipe.

Branch, don't rerun. A tail run (--tails: train.py's fp4_until = 1 - tail) is its FP4 run up to the
switch step s = round(fp4_until * max_iters), bit for bit: the same seed, weights, batches, RNG
draws and lr. So the FP4 run saves a checkpoint at each of its tails' s (train.py's
checkpoint_steps), and each tail resumes from it (resume_from) and trains only its last steps; the
checkpoint is deleted once its tail is recorded. A tail whose FP4 run finished without that
checkpoint (recorded before tails were asked for, or on another machine) runs whole: the same run.
"""

import argparse
import functools
import hashlib
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, replace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: train.py, data/, results/
sys.path.insert(0, ROOT)  # run as `python study/study.py` from anywhere

import analysis  # noqa: E402
import checkpoint  # noqa: E402
import configurator  # noqa: E402
import runlog  # noqa: E402
import train  # noqa: E402
from model import GPT, RECIPES, SIZES, config_for, fp4_switch_step, schedule_problem  # noqa: E402
from records import LAUNCH_ONLY, load_records, reruns_of, tokens_label, write_json  # noqa: E402,F401
# every run: train.py's GPU step of 32K tokens (64 x 512), as one micro-batch rather than two:
# the eager FP4 layers cost ~2 ms of host time each per micro-batch (docs/speed.md), so one halves
# that per token, and 64 x 512 still fits 30M-100M models in an H200. 50 eval batches per
# split = 1.6M val tokens an eval. No checkpoints but a BF16 tail's branch point: a run is the unit a study resumes by.
# The lm_head's cross-entropy runs 8K tokens at a time (model.chunked_cross_entropy, the same loss):
# the whole 32K x 100K FP32 logits would take ~25 GiB a run, and runs share the GPU (--jobs).
# At the end, the loss over the val split's first 4M tokens (the H200's whole 3.75M-token split), the
# same text for every run: the 50 random eval batches are drawn by the run's seed, so across seeds
# their sampling (eval SE ~0.017 at 30M) adds to the training's spread; paired gaps cancel it.
# compile_mode 'default': CUDA graphs (reduce-overhead) would take a step of quartet 67.2 -> 61.4 ms,
# nvfp4 84.7 -> 73.6, quartet2 142.3 -> 116.8 at 30M (bench.py, results/nvidia-h200/step/bench_step_30m_cuda_graphs.json), but
# train.py with evals fails under them on torch 2.11 (results/nvidia-h200/step/train_reduce_overhead_fails.log): refused there.
SETTINGS = dict(block_size=512, batch_size=64, gradient_accumulation_steps=1, eval_iters=50,
                always_save_checkpoint=False, log_interval=25, loss_chunk=8192, eval_split_tokens=4_000_000,
                compile_mode='default')
# settings a run recorded without them is still the same run for: eval_split_tokens adds a
# measurement after training (such a run lacks that number)
SAME_RUN = ('eval_split_tokens',)
# peak learning rate per size: train.py's 30M default and config/quartet_200m.py's 200M one,
# interpolated between, and below 30M extended along their slope (about N^-0.26); not tuned per
# recipe (the same for all: same-token, same-schedule runs)
LEARNING_RATE = {'tiny': 4e-3, '2m': 3e-3, '5m': 2.4e-3, '11m': 2e-3, '20m': 1.7e-3, '30m': 1.5e-3, '50m': 1.25e-3,
                 '100m': 1.1e-3, '200m': 1e-3, '430m': 8e-4, '800m': 6e-4, '1b': 6e-4}
EVALS = 4                   # evals after step 0, evenly spaced: the val curve
FULL_EVAL_TOKENS = 50e6     # runs this long get SETTINGS' eval_iters a curve eval; shorter ones fewer
STUDY_KEYS = ('recipe', 'seed', 'model_size', 'max_iters', 'eval_interval', 'out_dir')

# -----------------------------------------------------------------------------
# the runs: identity, train.py config

@dataclass(frozen=True)
class Run:
    size: str
    tokens: float           # the budget asked for; the run trains whole steps, recorded exactly
    recipe: str
    seed: int
    variant: str = ''       # a name for extra train.py flags ('' = none)
    flags: tuple = ()
    tail: float = 0.0       # > 0: this fraction of the steps at the end in BF16 (fp4_until = 1 - tail)

    @property
    def name(self):
        """The variant with the tail: 'tail10', 'tail10_adamw_fp4' (the tail first: analysis.py reads
        a '_fp4' ending and a 'no_' start as an optimizer twin and an ablation)."""
        return '_'.join(n for n in (self.tail and f'tail{round(100 * self.tail)}', self.variant) if n)

    @property
    def group(self):
        return self.recipe + (f'+{self.name}' if self.name else '')

    @property
    def id(self):
        return f'{self.size}-{tokens_label(self.tokens)}-{self.group.replace("+", "-")}-s{self.seed}'

    @property
    def train_flags(self):
        """The variant's train.py flags, and a tail's fp4_until."""
        return self.flags + ((f'--fp4_until={round(1 - self.tail, 6)!r}',) if self.tail else ())

    @property
    def parent(self):
        """The FP4 run a tail branches from: the same run without the tail (None for a plain run)."""
        return replace(self, tail=0.0) if self.tail else None

def grid(recipes, seeds, sizes, tokens, variant='', flags=(), tails=()):
    """The runs, seed-major: a study stopped part-way leaves whole seeds, which pair. tails: each
    recipe with FP4 GEMMs also with the last tail of its steps in BF16 (bf16 and float8 have none),
    listed after the plain runs of its seed (they branch from them)."""
    for r in recipes:
        if r not in RECIPES:
            raise ValueError(f"unknown recipe {r!r}; choose from {', '.join(RECIPES)}")
    for s in sizes:
        if s not in SIZES:
            raise ValueError(f"unknown size {s!r}; choose from {', '.join(SIZES)}")
    if variant and not re.fullmatch(r'[a-z0-9_]+', variant):
        raise ValueError(f'--variant={variant!r}: use lower-case letters, digits and _')
    if flags and not variant:
        raise ValueError(f'extra train.py flags {list(flags)} need a --variant name, so that '
                         'their runs are told apart from the plain ones')
    if any(t <= 0 for t in tokens) or any(s < 0 for s in seeds):
        raise ValueError(f'tokens must be > 0 and seeds >= 0, got {tokens} and {seeds}')
    for tail in tails:
        if not (0 < tail < 1 and abs(100 * tail - round(100 * tail)) < 1e-9):
            raise ValueError(f'--tails={tail}: a tail is a whole percent of the steps, 0.01 to 0.99')
    if tails and any(f.startswith('--fp4_until=') for f in flags):
        raise ValueError('--tails sets fp4_until for each tail run; it cannot also be a flag')
    fp4 = [r for r in recipes if schedule_problem(0.5, 2, r) is None]  # the recipes with FP4 GEMMs to switch
    return [Run(size, float(t), r, int(seed), variant, tuple(flags), float(tail))
            for seed in seeds for size in sizes for t in tokens
            for r, tail in [(r, 0.0) for r in recipes] + [(r, tail) for r in fp4 for tail in tails]]

def train_config(run, base_flags=(), settings=SETTINGS, work_dir=None):
    """The train.py config of a run: the study's settings, then base_flags (where: data_dir,
    device) and the variant's flags (checked by configurator), then the run's identity."""
    over = configurator.configure(train.DEFAULTS, [*base_flags, *run.train_flags])
    for key in STUDY_KEYS:
        if key in over:
            raise ValueError(f'--{key} is set by the study for each run; it cannot be a flag')
    cfg = {**settings, 'learning_rate': LEARNING_RATE.get(run.size, 1e-3), **over}
    if 'eval_iters' not in over:  # the curve's evals in proportion to a shorter run (eval_batches)
        cfg['eval_iters'] = eval_batches(cfg['eval_iters'], run.tokens)
    steps = max(1, round(run.tokens / step_tokens(cfg)))
    cfg.update(recipe=run.recipe, seed=run.seed, model_size=run.size, max_iters=steps,
               eval_interval=max(1, math.ceil(steps / EVALS)),
               out_dir=os.path.join(work_dir or os.path.join(ROOT, 'out', 'study'), run.id))
    return cfg

def eval_batches(full, tokens):
    """Batches per split of each curve eval: `full` for runs of FULL_EVAL_TOKENS or more, in
    proportion below (at least min(full, 10)): at 50 batches, a 13M-token run would spend ~40% of
    its time on evals, whose number is the split loss at the end (eval_split_tokens)."""
    return max(min(full, 10), round(full * min(1.0, tokens / FULL_EVAL_TOKENS)))

def step_tokens(cfg):
    return cfg['batch_size'] * cfg['block_size'] * cfg['gradient_accumulation_steps']

def train_argv(cfg):
    return [f'--{k}={v}' for k, v in cfg.items()]

def comparable(cfg):
    """The config a finished run must match to be reused: all but where files live (a branched
    tail's resume_from too: it is the same run as the whole one)."""
    return {k: v for k, v in cfg.items() if k not in ('out_dir', 'data_dir', 'resume_from')}

@functools.cache
def n_params(size, block_size, vocab_size=100352):
    """Non-embedding parameters (Quartet's N, SPEC.md 6), counted on the meta device."""
    with torch.device('meta'):
        return GPT(config_for(size, vocab_size=vocab_size, block_size=block_size)).get_num_params()

# -----------------------------------------------------------------------------
# records: one JSON a finished run; resuming

def gpu_slug(name=None):
    """'NVIDIA H200' -> 'nvidia-h200': this machine's GPU (or 'cpu'), or the device a record names."""
    name = name or (torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')
    return name.lower().replace(' ', '-')

def default_dir(device=None):
    return os.path.join(ROOT, 'results', gpu_slug(device), 'study')

def split_done(runs, configs, records):
    """(to run, done): a run is done when its JSON exists. A JSON under the same id made with
    another config (other flags, changed study settings) is an error, never silently mixed."""
    todo, done = [], []
    for run, cfg in zip(runs, configs):
        rec = records.get(run.id)
        if rec is None:
            todo.append((run, cfg))
            continue
        old, new = rec['train_config'], comparable(cfg)
        diff = [f'{k}: {old.get(k)!r} -> {new.get(k)!r}' for k in sorted(set(old) | set(new))
                if old.get(k) != new.get(k) and not (k in SAME_RUN and k not in old) and k not in LAUNCH_ONLY]
        if diff:
            raise ValueError(f"{run.id} exists with another config ({'; '.join(diff)}): give the "
                             'new runs another --variant name or another --results directory')
        done.append(rec)
    return todo, done

def write_bundle(directory, path):
    """directory as one .tar.gz, rewritten after every run: for machines whose files are
    collected from one path (a device lease that may end mid-study)."""
    with tarfile.open(path + '.tmp', 'w:gz') as tar:
        tar.add(directory, arcname=os.path.basename(directory))
    os.replace(path + '.tmp', path)

def merge(bundles, directory=None, log=print):
    """Bring the run JSONs of --bundle archives into directory (default: results/<the device each
    record names>/study), the way results come back from a GPU machine: a run not there is added;
    a run there is never replaced (finished runs are never rerun or overwritten). A bundle's record
    of an id held with other content is a rerun of it (made on a machine that lacked the first):
    it goes to <directory>_repeats/ as <id>.<n>.json, to show how far a rerun moves the loss.
    Reads the archives without extracting them. Returns (added, same, reruns): run ids."""
    records = {}  # directory -> its records, loaded once
    added, same, reruns = [], [], []
    for path in bundles:
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                name = os.path.basename(member.name)
                if not (member.isfile() and name.endswith('.json') and name != 'report.json'):
                    continue
                rec = json.load(tar.extractfile(member))
                if not (isinstance(rec, dict) and isinstance(rec.get('id'), str) and rec['id'] + '.json' == name):
                    raise ValueError(f'{path}: {member.name} is not a study run record (no id naming the file)')
                target = directory or default_dir(rec.get('device'))
                if target not in records:
                    records[target] = load_records(target)
                repeats_dir = target.rstrip(os.sep) + '_repeats'
                kept, earlier = records[target].get(rec['id']), reruns_of(repeats_dir, rec['id'])
                if kept is None:
                    os.makedirs(target, exist_ok=True)
                    write_json(os.path.join(target, name), rec)
                    records[target][rec['id']] = rec
                    added.append(rec['id'])
                elif rec == kept or rec in earlier:
                    if rec['id'] not in same:  # each bundle holds the whole results directory
                        same.append(rec['id'])
                else:
                    os.makedirs(repeats_dir, exist_ok=True)
                    n = len(earlier) + 1
                    while os.path.exists(os.path.join(repeats_dir, f"{rec['id']}.{n}.json")):
                        n += 1
                    write_json(os.path.join(repeats_dir, f"{rec['id']}.{n}.json"), rec)
                    reruns.append(rec['id'])
                    a, b = (r.get('val_loss_split') or r.get('val_loss') for r in (kept, rec))
                    log(f"{rec['id']}: a rerun, kept apart in {repeats_dir}"
                        + (f'; val loss {a:.4f} recorded, {b:.4f} rerun ({b / a - 1:+.2%})' if a and b else ''))
    log(f"{', '.join(sorted(records)) or 'nothing'}: {len(added)} runs added, {len(same)} already there, "
        f'{len(reruns)} reruns kept apart')
    return added, same, reruns

# -----------------------------------------------------------------------------
# running: subprocesses of train.py, a time budget, the record

def data_path(cfg):
    return cfg.get('data_dir') or os.path.join(ROOT, 'data', cfg.get('dataset', 'pycode'))

def corpus(cfg):
    """meta.json of the runs' data, with a fingerprint. data/pycode is prepared here if it is
    missing, once (runs preparing it at once would race), in a fresh process: its worker pool
    forks, and this one may hold a CUDA context."""
    path = data_path(cfg)
    if not os.path.exists(os.path.join(path, 'train.bin')):
        if cfg.get('data_dir') or cfg.get('dataset', 'pycode') != 'pycode':
            raise FileNotFoundError(f'{path}/train.bin not found: prepare that corpus first')
        subprocess.run([sys.executable, os.path.join(path, 'prepare.py')], check=True)
    with open(os.path.join(path, 'meta.json')) as f:
        meta = json.load(f)
    if 'train_sha1' not in meta:  # corpora from other scripts: hash the file
        sha = hashlib.sha1()
        with open(os.path.join(path, 'train.bin'), 'rb') as f:
            for block in iter(lambda: f.read(1 << 24), b''):
                sha.update(block)
        meta['train_sha1'] = sha.hexdigest()
    meta['train_tokens'] = os.path.getsize(os.path.join(path, 'train.bin')) // 4
    return {k: meta.get(k) for k in ('source', 'train_tokens', 'val_tokens', 'train_sha1', 'max_tokens')}

def estimate_s(run, cfg, records, directory, jobs=1):
    """Projected wall seconds of a run, for the budget. From finished runs of the same recipe
    (and variant, where there are such runs: a variant can train at another speed; else runs of
    the same train config under another name; else any of the recipe's), those that ran alone on
    the GPU where there are any (gpu_processes 1): the fastest tokens/s (other processes sharing
    the GPU only ever slow a run) and the median fixed cost (compile, evals). Runs of the same
    size first, run `jobs` at a time; else of another size, scaled by FLOPs a token; else the 30M
    train.py runs beside the study (results/<gpu>/train_30m_<recipe>.json, eager, 16K-token
    steps; the slowest of them for a recipe without one) scaled by FLOPs a token, plus 120 s.
    Times jobs where the records ran alone (sharing the GPU assumed to gain nothing). A tail that
    branches (cfg's resume_from) trains only the steps after its switch."""
    first = fp4_switch_step(cfg['fp4_until'], cfg['max_iters']) if cfg.get('resume_from') else 0
    tokens = (cfg['max_iters'] - first) * step_tokens(cfg)

    def flops(size):
        return flops_per_token(size, cfg['block_size'])

    mine = [r for r in records.values() if r['status'] == 'ok' and r['recipe'] == run.recipe and r['tokens_per_s']]
    mine = ([r for r in mine if r.get('group') == run.group]  # a variant's own runs first, then runs
            or [r for r in mine if _same_speed(r.get('train_config', {}), cfg)] or mine)  # of the same config
    alone = [r for r in mine if r.get('gpu_processes') == 1]  # tokens/s measured with the GPU to itself
    mine = alone or mine
    same = [r for r in mine if r['model_size'] == run.size]
    same_jobs = [r for r in same if r.get('jobs', 1) == jobs]
    if same_jobs or same or mine:
        rs = same_jobs or same or mine
        tps = max(r['tokens_per_s'] * flops(r['model_size']) / flops(run.size) for r in rs)
        fixed = statistics.median(max(0.0, r['wall_s'] - r.get('tokens_run', r['tokens']) / r['tokens_per_s']) for r in rs)
        return (fixed + tokens / tps) * (1 if same_jobs else jobs)
    measured = {}
    for recipe in RECIPES:
        path = os.path.join(os.path.dirname(os.path.abspath(directory)), f'train_30m_{recipe}.json')
        if os.path.exists(path):
            with open(path) as f:
                measured[recipe] = json.load(f)['tokens_per_s']
    tps30 = measured.get(run.recipe, min(measured.values(), default=1e5))
    return (120.0 + tokens / (tps30 * flops('30m') / flops(run.size))) * jobs

# train.py settings that do not change a step's speed (or that old records lack: compile_mode)
NOT_SPEED = ('seed', 'max_iters', 'eval_interval', 'eval_iters', 'log_interval', 'eval_split_tokens', 'compile_mode')

def _same_speed(recorded, cfg):
    """A finished run's train_config trains at cfg's speed: every recorded setting that bears on it equal."""
    return bool(recorded) and all(cfg.get(k) == v for k, v in recorded.items() if k not in NOT_SPEED)

def flops_per_token(size, block_size, vocab_size=100352):
    """6 N for the weights (lm_head included) + 6 L T d for causal attention: a scale only."""
    c = config_for(size, block_size=block_size)
    return 6 * (n_params(size, block_size) + vocab_size * c.n_embd) + 6 * c.n_layer * block_size * c.n_embd

def start(run, cfg, inprocess):
    """A subprocess of train.py (its own process group, so compile workers stop with it),
    or, inprocess, the run itself (tests, CPU)."""
    shutil.rmtree(cfg['out_dir'], ignore_errors=True)  # the study's own work dir: no stale summary
    os.makedirs(cfg['out_dir'])
    if inprocess:
        try:
            train.main(train_argv(cfg))
            return 0
        except SystemExit as e:
            with open(os.path.join(cfg['out_dir'], 'stderr.log'), 'w') as f:
                f.write(str(e.code))
            return 1
    with open(os.path.join(cfg['out_dir'], 'stdout.log'), 'w') as out:  # the child keeps its copy
        return subprocess.Popen([sys.executable, os.path.join(ROOT, 'train.py'), *train_argv(cfg)],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED='1'))

def gpu_processes():
    """How many processes hold a CUDA context on this machine's GPUs now (nvidia-smi's compute
    apps: study runs, tests, benchmarks alike); None where nvidia-smi cannot say (no GPU)."""
    try:
        out = subprocess.run(['nvidia-smi', '--query-compute-apps=pid', '--format=csv,noheader'],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return len([line for line in out.stdout.splitlines() if line.strip()]) if out.returncode == 0 else None

SHARING_POLL_S = 30  # how often run_study counts the GPU's processes for each running run

def stop(proc):
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    proc.wait()

def read_logs(out_dir):
    text = ''
    for fn in ('train.log', 'stdout.log', 'stderr.log'):
        path = os.path.join(out_dir, fn)
        if os.path.exists(path):
            with open(path, errors='replace') as f:
                text += f.read()
    return text

def make_record(run, cfg, rc, wall_s, context):
    """The run's JSON from out_dir/summary.json and train.log; None if it failed (retried
    next time). A run stopped on a non-finite loss is a result: status 'diverged'."""
    logs = read_logs(cfg['out_dir'])
    rec = dict(id=run.id, group=run.group, recipe=run.recipe, variant=run.name,
               flags=list(run.train_flags), seed=run.seed, model_size=run.size,
               tokens_requested=run.tokens, train_config=comparable(cfg), wall_s=wall_s,
               date=time.strftime('%Y-%m-%d %H:%M:%S'), **context)
    rec['tokens'] = cfg['max_iters'] * step_tokens(cfg)
    # a branched tail trained only its last steps here (tokens_per_s and wall_s are theirs); its curve is whole
    first = fp4_switch_step(cfg['fp4_until'], cfg['max_iters']) if cfg.get('resume_from') else 0
    rec['branched_from'] = dict(id=run.parent.id, step=first) if first else None
    rec['tokens_run'] = (cfg['max_iters'] - first) * step_tokens(cfg)
    rec['n_params'] = n_params(run.size, cfg['block_size'])  # Quartet's N: vocab-independent
    rec['epochs'] = rec['tokens'] / context['corpus']['train_tokens']
    m = re.search(r'non-finite loss .* at step (\d+)', logs)
    summary_path = os.path.join(cfg['out_dir'], 'summary.json')
    if rc == 0 and os.path.exists(summary_path):
        with open(summary_path) as f:
            s = json.load(f)
        curve = s['loss_curve']
        se = curve.get('val_loss_se') or [math.nan]
        rec.update(status='ok', val_loss=s['val_loss'], val_loss_se=se[-1],
                   val_loss_split=s.get('val_loss_split'), val_split_tokens=s.get('val_split_tokens'),
                   eval_train_loss=curve['eval_train_loss'][-1], tokens_per_s=s['tokens_per_s'],
                   train_wall_s=s['wall_s'], peak_mem_gib=s['peak_mem_gib'], device=s['device'],
                   curve=curve)
    elif m:
        rec.update(status='diverged', diverged_step=int(m.group(1)), val_loss=None,
                   tokens_per_s=None)
    else:
        return None
    line = re.search(r'^python .*$', logs, re.M)
    rec['versions'] = line.group(0) if line else None
    # every train.py setting as the run resolved it, its defaults included (train_config holds
    # only what the study set): a default that changes later does not blur what a record ran
    line = re.search(r'^config: (\{.*\})$', logs, re.M)
    rec['resolved_config'] = json.loads(line.group(1)) if line else None
    return rec

def add_branch_points(todo, base_flags=(), settings=SETTINGS, work_dir=None):
    """{tail run id: (its FP4 run's out_dir, switch step)} of the tails in todo; the config of each
    FP4 run in todo gets checkpoint_steps at its tails' switch steps, and the keep_checkpoints to keep
    them all (neither changes a number it trains: records.LAUNCH_ONLY)."""
    configs = {run.id: cfg for run, cfg in todo}
    points = {}
    for run, cfg in todo:
        if not run.tail:
            continue
        step = fp4_switch_step(cfg['fp4_until'], cfg['max_iters'])
        points[run.id] = train_config(run.parent, base_flags, settings, work_dir)['out_dir'], step
        parent = configs.get(run.parent.id)
        if parent is not None:
            steps = sorted({int(s) for s in parent.get('checkpoint_steps', '').split(',') if s} | {step})
            parent.update(checkpoint_steps=','.join(map(str, steps)), keep_checkpoints=max(2, len(steps)))
    return points

def branch_point(run, cfg, out_dir, step, log=print):
    """The checkpoint a tail resumes from: its FP4 run's at the switch step, if that run left one
    trained with the tail's config (but fp4_until); else None, and the tail runs whole."""
    path = checkpoint.at_step(out_dir, step)
    if path is None:
        log(f'{run.id}: no checkpoint of {run.parent.id} at step {step} in {out_dir}: it runs whole')
        return None
    saved = torch.load(path, map_location='cpu', weights_only=False, mmap=True)['config']
    diff = sorted(k for k, v in comparable(cfg).items()
                  if k not in ('fp4_until', *LAUNCH_ONLY) and saved.get(k, train.DEFAULTS.get(k)) != v)
    if diff:
        log(f"{run.id}: {path} was trained with other {', '.join(diff)}: it runs whole")
        return None
    return path

def run_study(runs, directory, base_flags=(), settings=SETTINGS, jobs=1, budget_s=None,
              inprocess=False, bundle=None, work_dir=None, log=print):
    """Run what is not done yet, up to jobs at a time; never start a run whose projected time
    (estimate_s, sharing the GPU with the runs going) does not fit in what is left of budget_s:
    wait for a running one to finish first, and skip it if it does not fit alone. Stop the ones
    still going when the budget runs out. A record's 'jobs' is how many of this study's runs shared
    the GPU at its start; its 'gpu_processes' the most processes (anyone's) seen on the GPU while it
    ran, counted every SHARING_POLL_S (None without nvidia-smi): 1 = it ran alone. A BF16 tail starts
    after its FP4 run is recorded, from that run's checkpoint at the switch step (branch_point), which
    is deleted once the tail is recorded; it is left undone if its FP4 run is. Returns (the new
    records, the runs left undone: failed, skipped or stopped)."""
    t0 = time.time()
    configs = [train_config(r, base_flags, settings, work_dir) for r in runs]
    records = load_records(directory)
    todo, done = split_done(runs, configs, records)
    log(f'{len(done)} of {len(runs)} runs done; {len(todo)} to run, {jobs} at a time')
    if inprocess and jobs != 1:
        raise ValueError('in-process runs go one at a time (jobs=1)')
    if not todo:
        return [], []
    points = add_branch_points(todo, base_flags, settings, work_dir)
    os.makedirs(directory, exist_ok=True)
    commit, dirty = runlog.git_state()
    # prepared before the first run starts (the budget counts it): a variant may use other data
    corpora = {data_path(cfg): cfg for _, cfg in todo}
    corpora = {path: corpus(cfg) for path, cfg in corpora.items()}
    for path, c in corpora.items():
        log(f"corpus {path}: {c['train_tokens']:,} train tokens ({c['source']})")
    new, left, running = [], [], []
    polled = -math.inf

    def left_s():
        return math.inf if budget_s is None else budget_s - (time.time() - t0)

    while todo or running:
        while todo and len(running) < jobs:
            going = {r.id for r, _ in todo} | {item[0].id for item in running}
            i = next((i for i, (r, _) in enumerate(todo) if not (r.tail and r.parent.id in going)), None)
            if i is None:  # tails whose FP4 run goes on: they start once it is recorded
                break
            run, cfg = todo[i]
            if run.tail and run.parent.id in {r.id for r in left}:
                log(f'skip {run.id}: its FP4 run {run.parent.id} is not done')
                left.append(todo.pop(i)[0])
                continue
            if run.id in points and 'resume_from' not in cfg:
                path = branch_point(run, cfg, *points.pop(run.id), log=log)
                cfg.update({'resume_from': path} if path else {})
            sharing = len(running) + 1  # the runs on the GPU once it starts
            est = estimate_s(run, cfg, records, directory, sharing)
            if est > left_s():
                if running:  # it may fit once fewer runs share the GPU: wait for one to finish
                    break
                log(f'skip {run.id}: projected {est / 60:.1f} min, {left_s() / 60:.1f} left')
                left.append(todo.pop(i)[0])
                continue
            todo.pop(i)
            path = data_path(cfg)
            context = dict(git_commit=commit, git_dirty=dirty, jobs=sharing, corpus=corpora[path])
            epochs = cfg['max_iters'] * step_tokens(cfg) / corpora[path]['train_tokens']
            if epochs > 1:
                log(f'warning: {run.id} reads {epochs:.2f} epochs of its train split ({path}); '
                    'data/pycode/prepare.py --max_tokens=... makes a larger one where the machine has it')
            log(f'start {run.id} (projected {est / 60:.1f} min): train.py {" ".join(train_argv(cfg))}')
            running.append((run, cfg, context, start(run, cfg, inprocess), time.time()))
        if running and not inprocess and time.time() - polled >= SHARING_POLL_S:
            polled, n = time.time(), gpu_processes()
            for _, _, context, _, _ in running:
                seen = context.get('gpu_processes')
                context['gpu_processes'] = n if seen is None else max(seen, n or 0)
        for item in list(running):
            run, cfg, context, proc, t_start = item
            rc = proc if isinstance(proc, int) else proc.poll()
            if rc is None and left_s() > 0:
                continue
            running.remove(item)
            if rc is None:
                stop(proc)
                log(f'stopped {run.id}: the budget ran out')
                left.append(run)
                continue
            rec = make_record(run, cfg, rc, time.time() - t_start, context)
            if rec is None:
                tail = '\n'.join(read_logs(cfg['out_dir']).splitlines()[-15:])
                log(f'FAILED {run.id} (exit {rc}); not recorded, so a later call retries it:\n{tail}')
                left.append(run)
                continue
            write_json(os.path.join(directory, run.id + '.json'), rec)
            records[run.id] = rec
            new.append(rec)
            if cfg.get('resume_from'):  # the branch point served its one tail
                os.remove(cfg['resume_from'])
            log(f"done {run.id}: {rec['status']}, val loss {rec['val_loss']}, "
                f"{rec['tokens_per_s'] or 0:,.0f} tok/s, {rec['wall_s'] / 60:.1f} min, "
                f"{rec.get('gpu_processes')} process(es) on the GPU at most")
            if bundle:
                write_bundle(directory, bundle)
        if running:
            time.sleep(1)
    return new, left

def plan(runs, directory, base_flags=(), settings=SETTINGS, jobs=1, work_dir=None, log=print):
    """What `run` would do, with projected times; runs nothing. A tail branches where its FP4 run is
    to run too, or left its checkpoint."""
    configs = [train_config(r, base_flags, settings, work_dir) for r in runs]
    records = load_records(directory)
    todo, done = split_done(runs, configs, records)
    points, ids = add_branch_points(todo, base_flags, settings, work_dir), {r.id for r, _ in todo}
    total = 0.0
    for run, cfg in todo:
        out_dir, step = points.get(run.id, (None, 0))
        branched = out_dir and (run.parent.id in ids or branch_point(run, cfg, out_dir, step, log=lambda m: None))
        est = estimate_s(run, dict(cfg, resume_from='branched') if branched else cfg, records, directory, jobs)
        total += est
        log(f'{run.id}: {cfg["max_iters"]} steps' + (f', branched from {run.parent.id} at step {step}' if branched else '')
            + f', projected {est / 60:.1f} min')
    log(f'{len(done)} done, {len(todo)} to run: projected {total / 60:.0f} min of runs, {jobs} at a '
        f'time ({total / 60 / jobs:.0f} min of wall time)')
    return todo

# -----------------------------------------------------------------------------
# command line

def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = argv[argv.index('--') + 1:] if '--' in argv else []
    argv = argv[:argv.index('--')] if '--' in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0].strip())
    sub = parser.add_subparsers(dest='command', required=True)
    for name in ('run', 'plan'):
        p = sub.add_parser(name, help=f'{name} the runs not done yet (train.py flags of a variant after --)')
        p.add_argument('--recipes', default='bf16,quartet,nvfp4,quartet2')
        p.add_argument('--seeds', default='0,1,2')
        p.add_argument('--sizes', default='30m', help=f"model sizes: {', '.join(SIZES)}")
        p.add_argument('--tokens', default='50e6', help='token budgets, e.g. 25e6,50e6')
        p.add_argument('--variant', default='', help='the name of the train.py flags given after --')
        p.add_argument('--tails', default='', help='e.g. 0.1,0.2: each FP4 recipe also with the last 10%%, 20%% of '
                       'its steps in BF16 (train.py fp4_until), branched from its FP4 run')
        p.add_argument('--jobs', type=int, default=1, help='runs at once on the one GPU')
        p.add_argument('--budget_min', type=float, default=None,
                       help='start only runs that fit in these minutes; stop what runs at the end')
        p.add_argument('--bundle', default=None, help='rewrite this .tar.gz of the results after each run')
        p.add_argument('--data_dir', default='', help="train.py's data_dir for every run")
        p.add_argument('--results', default=None, help='default: results/<gpu>/study')
        p.add_argument('--inprocess', action='store_true', help='run train.main here (no subprocess)')
    p = sub.add_parser('merge', help="add the runs of --bundle archives to the results (never replacing one)")
    p.add_argument('bundles', nargs='+', help='.tar.gz files written by study.py run --bundle')
    p.add_argument('--results', default=None, help="default: results/<each run's gpu>/study")
    p = sub.add_parser('report', help='tables, curves and the law fit from the run JSONs')
    p.add_argument('--results', default=None, help='default: results/<gpu>/study')
    p.add_argument('--law', default='auto', choices=('auto', 'quartet', 'free'),
                   help="exponents: fitted where the data pins them (auto), Quartet's, or fitted")
    p.add_argument('--boot', type=int, default=200, help='bootstrap resamples for effN, effD')
    p.add_argument('--law_min_tpp', type=float, default=0.0,
                   help='fit the law only to the cells with at least this many tokens a parameter')
    args = parser.parse_args(argv)
    directory = args.results or default_dir()
    if args.command == 'merge':
        merge(args.bundles, args.results)
        return 0
    if args.command == 'report':
        analysis.report(directory, args.law, args.boot, min_tokens_per_param=args.law_min_tpp)
        return 0
    runs = grid(args.recipes.split(','), [int(s) for s in args.seeds.split(',')],
                args.sizes.split(','), [float(t) for t in args.tokens.split(',')], args.variant, flags,
                [float(t) for t in args.tails.split(',') if t])
    base = [f'--data_dir={args.data_dir}'] if args.data_dir else []
    if args.command == 'plan':
        plan(runs, directory, base, jobs=args.jobs)
        return 0
    budget = args.budget_min * 60 if args.budget_min else None
    new, left = run_study(runs, directory, base, jobs=args.jobs, budget_s=budget,
                          inprocess=args.inprocess, bundle=args.bundle)
    print(f'{len(new)} runs recorded in {directory}; {len(left)} left for a later call')
    return 0

if __name__ == '__main__':
    try:
        sys.exit(main())
    except (ValueError, configurator.ConfigError) as e:
        sys.exit(f'study.py: {e}')
