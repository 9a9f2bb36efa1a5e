"""
Pretraining with FP4 linear layers, nanoGPT-style: config globals, then one loop.

$ python train.py                          # prepares data/pycode if needed, trains a small model
$ python train.py --recipe=nvfp4 --max_iters=500
$ python train.py config/quartet_30m.py --resume=True
$ torchrun --standalone --nproc_per_node=8 train.py config/quartet_30m.py
$ torchrun --standalone --nproc_per_node=8 train.py config/llama_1b.py --fsdp=True  # sharded

Recipes (SPEC.md 5): bf16 (baseline), quartet (MXFP4), nvfp4 (NVIDIA), quartet2 (Quartet II),
fullstack (NVFP4 four-over-six + a BF16 LoRA-SVD part, SPEC.md 8.4).
Writes to out_dir: train.log (config, versions, GPU, every step), ckpt.pt, loss.png,
summary.json.
"""

import contextlib
import importlib.util
import json
import math
import os
import platform
import random
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import configurator
import optim
from model import (ATTENTIONS, END_BLOCKS, GPT, GPTConfig, RECIPES, RECOMPUTES, SIZES, apply_recipe, config_for,
                   fp4_blocks, gemm_multiple)

# -----------------------------------------------------------------------------
# config: every global here can be overridden by config/*.py and --key=value
# I/O
out_dir = 'out'
log_interval = 1
always_save_checkpoint = True  # at every eval
resume = False            # continue from out_dir/ckpt.pt, bit-exact on CPU
resume_from = ''          # continue from this checkpoint file instead (implies resume)
keep_checkpoints = 2      # keep the newest N: ckpt.pt, then ckpt.<step>.pt for the older ones
sample_tokens = 100       # at the end, print this many tokens generated after 'def ' (0: none)
eval_split_tokens = 0     # > 0: at the end, the loss over the val split's first this-many tokens, the same text for every seed
# data
dataset = 'pycode'        # data/<dataset>/{train,val}.bin; pycode is prepared on first use
data_dir = ''             # set to read the .bin files from elsewhere
# model
n_kv_head = 0             # 0: as many kv heads as query heads; fewer: GQA
recipe = 'quartet'        # one of model.RECIPES
lora_rank = 0             # fullstack: rank of the BF16 part; 0: the default rule, -1: none
lora_refit_interval = 4000  # fullstack: refit L by randomized SVD every this many steps (and at 0)
lora_refit_first = 50     # fullstack: also refit at this step and each doubling of it below the interval (0: none)
end_blocks = 'auto'       # one of model.END_BLOCKS: 'bf16' keeps the first and last blocks in BF16 (nvfp4's rule), 'fp4' runs them FP4 too
attention = 'bf16'        # one of model.ATTENTIONS: 'nvfp4' is FP4 attention (attention.py), any recipe
loss_chunk = 0            # > 0: cross-entropy over the lm_head this many tokens at a time (the logits never whole)
recompute = 'none'        # one of model.RECOMPUTES: 'mlp' reruns ln_2 -> gate_up -> SwiGLU in the backward (less memory)
# AdamW and the lr schedule (Quartet's: betas (0.9, 0.95), wd 0.1, clip 1, cosine, 10% warmup)
optimizer = 'adamw'  # adamw | adamw_fp4 | muon | root | root_fp4 (optim.build)
ns_precision = ''         # ablations: the Muon family's Newton-Schulz precision instead of the optimizer's ('' = its own)
optimizer_states = ''     # ablations: the optimizer's states instead of its own: fp32 | nvfp4 (AdamW's and ROOT's), bf16 | nvfp4x2 (ROOT's momentum; AdamW's part FP32 | NVFP4)
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0           # 0: no clipping (the norm is still computed and checked)
warmup_iters = -1         # -1: 10% of lr_decay_iters
lr_decay_iters = -1       # -1: max_iters
min_lr_frac = 0.1         # cosine ends at learning_rate * min_lr_frac
# system
device = 'cuda' if torch.cuda.is_available() else 'cpu'
dtype = 'bfloat16' if torch.cuda.is_available() else 'float32'  # autocast dtype
compile = torch.cuda.is_available()
compile_mode = 'default'  # torch.compile's mode; the CUDA-graph ones (reduce-overhead) are refused: README, Speed
fsdp = False              # torchrun: shard weights, grads and optimizer states (FSDP2), not DDP
cuda_graph = False        # replay each micro-step's forward and backward as CUDA graphs (one GPU process)
seed = 1337
debug_nan_step = -1       # tests: make the loss NaN at this step
# size, batch and length of the run: what `python train.py` does depends on the device
if torch.cuda.is_available():
    # a GPU: Quartet's 30M model at seq 512, 64 x 512 = 32K tokens a step, ~65M tokens
    model_size = '30m'    # a key of model.SIZES
    block_size = 512
    batch_size = 32       # sequences per micro-step per rank
    gradient_accumulation_steps = 2  # micro-steps per optimizer step, summed over all ranks
    max_iters = 2000
    learning_rate = 1.5e-3
    eval_interval = 250   # eval (and checkpoint) every this many steps, and at the end
    eval_iters = 20       # batches per split per eval
else:
    # a 2-core CPU. The 128 x 100352 lm_head is most of the work, ~1.6 ms of CPU a token
    # (the FP4 reference quantizers add ~40%), so what a few minutes teach is set by the
    # tokens: 160 steps of 8 x 64 (82K tokens) at a peak lr of 1e-2 (README: time, loss)
    model_size = 'tiny'
    block_size = 64
    batch_size = 8
    gradient_accumulation_steps = 1
    max_iters = 160
    learning_rate = 1e-2
    eval_interval = 40
    eval_iters = 2

config_keys = [k for k, v in globals().items()
               if not k.startswith('_') and isinstance(v, (int, float, bool, str))]
DEFAULTS = {k: globals()[k] for k in config_keys}
HERE = os.path.dirname(os.path.abspath(__file__))
COMPILE_MODES = ('default', 'reduce-overhead', 'max-autotune', 'max-autotune-no-cudagraphs')
CUDA_GRAPH_MODES = ('reduce-overhead', 'max-autotune')  # refused by check_config: measured to fail here
_log_path = None  # out_dir/train.log on the master rank, set in main()
_overrides = {}   # the keys that config files and --key=value set, set in setup()
_resumed_step = None  # the step of the out_dir/ckpt.pt this run resumed from, set in init_run()

# -----------------------------------------------------------------------------
# setup: checks, distributed, logging

def check_config():
    if recipe not in RECIPES:
        raise configurator.ConfigError(f"unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
    if recipe == 'float8' and importlib.util.find_spec('torchao') is None:
        raise configurator.ConfigError("recipe 'float8' is torchao's float8 training, and torchao is not "
                                       "installed: pip install torchao")
    if attention not in ATTENTIONS:
        raise configurator.ConfigError(f"unknown attention {attention!r}; choose one of {', '.join(ATTENTIONS)}")
    if end_blocks not in END_BLOCKS:
        raise configurator.ConfigError(f"unknown end_blocks {end_blocks!r}; choose one of {', '.join(END_BLOCKS)}")
    if model_size not in SIZES:
        raise configurator.ConfigError(f"unknown model_size {model_size!r}; "
                                       f"choose one of {', '.join(SIZES)}")
    if optimizer not in optim.OPTIMIZERS:
        raise configurator.ConfigError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(optim.OPTIMIZERS)}")
    if dtype not in ('float32', 'bfloat16'):
        raise configurator.ConfigError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    if loss_chunk < 0:
        raise configurator.ConfigError(f'loss_chunk must be 0 (whole logits) or a token count > 0, got {loss_chunk}')
    if recompute not in RECOMPUTES:
        raise configurator.ConfigError(f"unknown recompute {recompute!r}; choose one of {', '.join(RECOMPUTES)}")
    try:  # ns_precision / optimizer_states against the optimizer, before any model is built
        optim.build(torch.nn.Linear(16, 16), optimizer, ns=ns_precision or None, states=optimizer_states or None)
    except ValueError as e:
        raise configurator.ConfigError(f'--optimizer={optimizer} with --ns_precision={ns_precision!r} '
                                       f'--optimizer_states={optimizer_states!r}: {e}')
    if compile_mode not in COMPILE_MODES:
        raise configurator.ConfigError(f"unknown compile_mode {compile_mode!r}; choose one of {', '.join(COMPILE_MODES)}")
    if compile and compile_mode in CUDA_GRAPH_MODES:
        raise configurator.ConfigError(
            f'compile_mode={compile_mode!r} (CUDA graphs) fails in train.py on the H200 with torch 2.11: the '
            'first backward after an eval reads activations that a later graph replay overwrote, with or '
            'without torch.compiler.cudagraph_mark_step_begin() before each forward '
            '(results/nvidia-h200/session8/smoke.log; PyTorch issues 152887, 169545). '
            "Use 'default' or 'max-autotune-no-cudagraphs'; bench.py --compile-mode reduce-overhead "
            'times a single training step, which does work')
    if cuda_graph and not device.startswith('cuda'):
        raise configurator.ConfigError(f'cuda_graph=True needs a CUDA device, got device={device!r}')
    if cuda_graph and recompute != 'none':
        raise configurator.ConfigError(f"cuda_graph=True with recompute={recompute!r}: the recompute's checkpoint "
                                       "saves and restores the GPU's RNG state, which a CUDA graph capture forbids")
    if eval_split_tokens < 0:
        raise configurator.ConfigError(f'eval_split_tokens must be 0 (none) or a token count, got {eval_split_tokens}')
    if keep_checkpoints < 1:
        raise configurator.ConfigError(f'keep_checkpoints must be at least 1, got {keep_checkpoints}')
    check_shapes()

def check_shapes():
    """The dims and token counts the recipe's FP4 (or FP8) GEMMs must divide, checked now rather
    than in the first forward: every block linear's in and out features, and the tokens of a
    micro-step (batch_size * block_size), over which the weight gradient's GEMM runs."""
    try:
        cfg = config_for(model_size, block_size=block_size, n_kv_head=n_kv_head)
    except (AssertionError, ValueError) as e:
        raise configurator.ConfigError(f'model_size={model_size!r} with n_kv_head={n_kv_head}: {e}')
    mult = gemm_multiple(recipe)
    if mult == 1:
        return
    tokens = batch_size * block_size
    if tokens % mult:
        step = mult // math.gcd(batch_size, mult)  # block_size must be a multiple of this
        fits = [b for b in (block_size // step * step, (block_size // step + 1) * step) if b]
        raise configurator.ConfigError(
            f'recipe {recipe!r} needs batch_size * block_size divisible by {mult} (its low-precision GEMMs '
            f'run over the tokens of a micro-step), got {batch_size} * {block_size} = {tokens}: '
            f"use e.g. --block_size={' or '.join(map(str, fits))}, or another batch_size")
    hs = cfg.n_embd // cfg.n_head
    dims = dict(n_embd=cfg.n_embd, ffn_hidden=cfg.ffn_hidden,
                qkv_width=(cfg.n_head + 2 * cfg.n_kv_head) * hs)
    bad = {k: v for k, v in dims.items() if v % mult}
    if bad:
        raise configurator.ConfigError(f'recipe {recipe!r} needs every block linear dim divisible by '
                                       f'{mult}; model_size={model_size!r}, n_kv_head={n_kv_head} '
                                       f'give {bad}: choose another n_kv_head or model_size')

def init_distributed():
    """(rank, local_rank, world_size); torchrun sets RANK, LOCAL_RANK and WORLD_SIZE."""
    if int(os.environ.get('RANK', -1)) == -1:
        return 0, 0, 1
    dist.init_process_group(backend='nccl' if device.startswith('cuda') else 'gloo')
    return dist.get_rank(), int(os.environ['LOCAL_RANK']), dist.get_world_size()

def log(msg):
    if _log_path is None:
        return
    print(msg, flush=True)
    with open(_log_path, 'a') as f:
        f.write(msg + '\n')

def log_header(config):
    """What a run needs to be reproduced and compared: command, versions, hardware, config."""
    log(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(sys.argv)}")
    log(f'python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}, '
        f'{platform.platform()}')
    if os.environ.get('FP4_GIT_COMMIT'):  # a copy of the tree whose .git is not its code's (study.py)
        log(f"git commit {os.environ['FP4_GIT_COMMIT']} (FP4_GIT_COMMIT)")
    else:
        try:
            commit = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=HERE, capture_output=True,
                                    text=True, timeout=10).stdout.strip()
            log(f'git commit {commit or "unknown"}')
        except (OSError, subprocess.SubprocessError):
            pass
    if device.startswith('cuda'):
        log(f'GPU: {torch.cuda.get_device_name()} x {torch.cuda.device_count()}, '
            f'CUDA {torch.version.cuda}')
    if shutil.which('nvidia-smi'):
        log(subprocess.run(['nvidia-smi'], capture_output=True, text=True, timeout=30).stdout)
    if recipe == 'float8':
        import torchao
        log(f'float8: torchao {torchao.__version__}, tensorwise scales')
    elif recipe != 'bf16':
        import fp4
        if hasattr(fp4, 'backends'):
            log(f'fp4 backends: {fp4.backends()}')
    log('config: ' + json.dumps(config, sort_keys=True))

def peak_mem_gib():
    if device.startswith('cuda'):
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # peak RSS, KiB on Linux

# -----------------------------------------------------------------------------
# data

def load_data(master):
    """Memmaps of the train and val tokens, and meta.json. data/pycode is made on first use."""
    path = data_dir or os.path.join(HERE, 'data', dataset)
    if not os.path.exists(os.path.join(path, 'train.bin')):
        if data_dir or dataset != 'pycode':
            raise SystemExit(f'{path}/train.bin not found: run data/{dataset}/prepare.py, or point '
                             f'--data_dir at the folder with train.bin, val.bin and meta.json')
        if master:
            log(f'{path}/train.bin not found: preparing the default corpus (Python sources)')
            script = os.path.join(path, 'prepare.py')  # a script, not a package: load by path
            spec = importlib.util.spec_from_file_location('pycode_prepare', script)
            prepare = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(prepare)
            prepare.prepare(path)
        if dist.is_initialized():
            dist.barrier()  # the other ranks wait for the files
    meta = read_meta(path)
    data = {s: read_bin(os.path.join(path, f'{s}.bin'), meta['vocab_size']) for s in ('train', 'val')}
    return data, meta

def remake_hint():
    if data_dir:
        return (f'make {data_dir} again (train.bin, val.bin: uint32 token ids; meta.json: '
                f'vocab_size), e.g. with data/<name>/prepare.py')
    return f'run data/{dataset}/prepare.py again'

def read_meta(path):
    """meta.json, checked: the vocabulary size, and uint32 ids (what prepare.py writes)."""
    fn = os.path.join(path, 'meta.json')
    redo = remake_hint()
    try:
        with open(fn) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise SystemExit(f'{fn} not found: it gives the vocabulary size of the .bin files; {redo}')
    except (OSError, ValueError) as e:
        raise SystemExit(f'{fn} is not readable JSON ({e}): {redo}')
    if not isinstance(meta, dict) or not isinstance(meta.get('vocab_size'), int):
        raise SystemExit(f'{fn} has no integer vocab_size: {redo}')
    if meta.get('dtype', 'uint32') != 'uint32':
        raise SystemExit(f"{fn} says the token ids are {meta['dtype']}; train.py reads uint32 "
                         f'(4 bytes a token): {redo}')
    return meta

def read_bin(fn, vocab):
    """A read-only memmap of uint32 token ids, after checking that the file is whole tokens,
    long enough for a batch, and holds no id outside the vocabulary (the embedding would
    fail on it mid-run, on a GPU as a device-side assert)."""
    redo = remake_hint()
    if not os.path.exists(fn):
        raise SystemExit(f'{fn} not found: {redo}')
    size = os.path.getsize(fn)
    if size % 4:
        raise SystemExit(f'{fn} is {size} bytes, not a whole number of uint32 tokens (4 bytes '
                         f'each): it is truncated or was written with another dtype; {redo}')
    arr = np.memmap(fn, dtype=np.uint32, mode='r') if size else np.zeros(0, np.uint32)
    if len(arr) <= block_size + 1:
        raise SystemExit(f'{fn} has {len(arr)} tokens, fewer than block_size + 2 = {block_size + 2}: '
                         f'use more data or a smaller --block_size')
    chunk = 1 << 24  # 64 MiB at a time: bounded memory for multi-GB files
    top = max(int(arr[i:i + chunk].max()) for i in range(0, len(arr), chunk))
    if top >= vocab:
        raise SystemExit(f'{fn} holds token id {top}, but meta.json says vocab_size {vocab}: '
                         f'the .bin files and meta.json do not match; {redo}')
    return arr

def get_batch(data, key):
    """x, y: (batch_size, block_size) int64. The offsets are a pure function of (seed, key),
    e.g. key = (0, step, micro-step): no sampler state, so a resumed run reads exactly the
    batches the uninterrupted run would have, and the global batch of a step does not
    depend on how many ranks share it."""
    rng = np.random.default_rng([seed, *key])
    ix = rng.integers(0, len(data) - block_size, size=batch_size)
    x = torch.from_numpy(np.stack([data[i:i + block_size] for i in ix]).astype(np.int64))
    y = torch.from_numpy(np.stack([data[i + 1:i + 1 + block_size] for i in ix]).astype(np.int64))
    if device.startswith('cuda'):
        x, y = x.pin_memory(), y.pin_memory()  # async host-to-device copies
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    return x, y

# -----------------------------------------------------------------------------
# model, eval, lr schedule, checkpoints

def build_model(model_args):
    model = GPT(GPTConfig(**model_args))
    return apply_recipe(model, recipe)  # block linears -> FP4Linear (not for bf16)

def build_optimizer(model):
    """optim.build: AdamW, or Muon/ROOT on the 2-D hidden weights and AdamW on the rest. One
    learning_rate and schedule for both: the Muon family's update is scaled to AdamW's RMS
    (optim.update_scale 'rms', README 'Muon and ROOT with FP4 Newton-Schulz')."""
    return optim.build(model, optimizer, lr=learning_rate, weight_decay=weight_decay, betas=(beta1, beta2),
                       ns=ns_precision or None, states=optimizer_states or None)

@contextlib.contextmanager
def evaluating(model):
    """Eval mode inside a forked RNG: an eval must not move the training RNG stream (FP4 recipes
    draw from it), so a run stopped at any eval resumes exactly; train mode again after."""
    devices = [torch.cuda.current_device()] if device.startswith('cuda') else []
    with torch.random.fork_rng(devices=devices):
        model.eval()
        try:
            yield
        finally:
            model.train()

def forward_loss(model, x, y, ctx):
    """The model's loss on (x, y) under ctx (autocast)."""
    with ctx:
        return model(x, y)[1]

@torch.no_grad()
def estimate_loss(model, data, ctx, rank):
    """Mean loss over eval_iters fixed batches per split (the same batches every eval)."""
    out = {}
    with evaluating(model):
        for si, split in enumerate(('train', 'val')):
            losses = torch.zeros(eval_iters, device=device)
            for k in range(eval_iters):
                x, y = get_batch(data[split], (1 + si, k, rank))
                loss = forward_loss(model, x, y, ctx)
                losses[k] = loss.float()
            mean = losses.mean()
            if dist.is_initialized():
                dist.all_reduce(mean, op=dist.ReduceOp.AVG)
            out[split] = mean.item()
            # standard error of this rank's mean (independent batches): study.py sets it beside seed noise
            out[f'{split}_se'] = (losses.std() / math.sqrt(eval_iters)).item() if eval_iters > 1 else math.nan
    return out

def split_batches(val_tokens, world):
    """How many whole batches of every rank split_loss reads; an error before training if none."""
    n = min(eval_split_tokens, val_tokens - 1) // (batch_size * block_size * world)
    if n == 0:
        raise SystemExit(f'eval_split_tokens={eval_split_tokens}: less than one batch of all ranks '
                         f'({batch_size * block_size * world} tokens) in the first eval_split_tokens '
                         f'of the {val_tokens:,}-token val split; raise it, or 0 for none')
    return n

@torch.no_grad()
def split_loss(model, val, ctx, rank, world):
    """(mean loss, tokens) over the first eval_split_tokens tokens of the val split, cut into
    consecutive block_size windows, batch_size at a time, the ranks sharing the batches. Unlike
    estimate_loss's random windows, which the run's seed draws, this is the same text for every
    seed and run, so the seeds' spread is the training's alone (study.py, README 'Accuracy').
    Whole batches only (one compiled shape): the tail of fewer than batch_size * world windows is left out."""
    per_batch, n_batches = batch_size * block_size, split_batches(len(val), world)
    total = torch.zeros((), device=device, dtype=torch.float64)
    with evaluating(model):
        for b in range(rank, n_batches * world, world):
            i = b * per_batch + np.arange(batch_size)[:, None] * block_size + np.arange(block_size + 1)
            win = torch.from_numpy(val[i.ravel()].astype(np.int64).reshape(batch_size, block_size + 1))
            x, y = (t.to(device) for t in (win[:, :-1], win[:, 1:]))
            loss = forward_loss(model, x, y, ctx)
            total += loss.double()  # each batch has the same token count: the mean of means is the mean
    if dist.is_initialized():
        dist.all_reduce(total)
    return (total / (n_batches * world)).item(), n_batches * world * per_batch

def lora_refit_due(step, interval, first):
    """Whether fullstack refits L (SPEC.md 8.4) before this step: at 0 and every `interval` steps
    (the paper's schedule), and below the first interval also at first, 2 first, 4 first, ...
    The fit at step 0 is of the random init, whose top directions the trained W does not keep
    (README, "How stale L gets": it cuts the FP4 error by 1.1%, a refit by 56.9%), and W's top
    directions form early and then hold (an L fitted 80 steps before keeps 82% of a refit's
    cut): so refits come often at first and then spread out. interval <= 0: never (L stays 0)."""
    if interval <= 0:
        return False
    if step % interval == 0:
        return True
    if first <= 0 or step >= interval or step < first or step % first:
        return False
    ratio = step // first
    return ratio & (ratio - 1) == 0  # a power of two

def get_lr(it, warmup, decay_iters):
    """Linear warmup, then cosine down to learning_rate * min_lr_frac."""
    min_lr = learning_rate * min_lr_frac
    if it < warmup:
        return learning_rate * (it + 1) / (warmup + 1)
    if it >= decay_iters:
        return min_lr
    ratio = (it - warmup) / max(1, decay_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)

def rng_states():
    s = {'python': random.getstate(), 'numpy': np.random.get_state(), 'torch': torch.get_rng_state()}
    if device.startswith('cuda'):
        s['cuda'] = torch.cuda.get_rng_state()  # this rank's device
    return s

def set_rng_states(s):
    random.setstate(s['python'])
    np.random.set_state(s['numpy'])
    torch.set_rng_state(s['torch'])
    if 'cuda' in s and device.startswith('cuda'):
        torch.cuda.set_rng_state(s['cuda'])

# -----------------------------------------------------------------------------
# checkpoint files: the newest is out_dir/ckpt.pt, older ones ckpt.<step>.pt

def checkpoint_path(step=None):
    return os.path.join(out_dir, 'ckpt.pt' if step is None else f'ckpt.{step}.pt')

def checkpoint_step(path):
    """The step in an older checkpoint's name, ckpt.<step>.pt; None for any other name."""
    parts = os.path.basename(path).split('.')
    ok = len(parts) == 3 and parts[0] == 'ckpt' and parts[1].isdigit() and parts[2] == 'pt'
    return int(parts[1]) if ok else None

def older_checkpoints():
    """[(step, path)] of the kept older checkpoints, newest first."""
    names = os.listdir(out_dir) if os.path.isdir(out_dir) else []
    return sorted(((checkpoint_step(fn), os.path.join(out_dir, fn)) for fn in names
                   if checkpoint_step(fn) is not None), reverse=True)

def save_checkpoint(state, prev_step):
    """Write state to a temp file, fsync it, then rename it to ckpt.pt: a crash or a kill at
    any moment leaves the last good checkpoint. The ckpt.pt it replaces, of this run's step
    prev_step, is kept as ckpt.<prev_step>.pt; the newest keep_checkpoints stay. A failed
    write (disk full, permissions) stops the run and leaves the earlier files as they were."""
    path, step = checkpoint_path(), state['iter_num']
    tmp = path + '.tmp'
    try:
        with open(tmp, 'wb') as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        if os.environ.get('TRAIN_TEST_SLOW_SAVE') == str(step):  # tests: a kill mid-save
            log(f'test hook: {tmp} written, sleeping before the rename')
            time.sleep(600)
        if keep_checkpoints > 1 and prev_step is not None and os.path.exists(path):
            os.replace(path, checkpoint_path(prev_step))
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch.save raises OSError for a file object
        if os.path.lexists(tmp):
            os.remove(tmp)
        kept = path if os.path.exists(path) else 'none'
        raise SystemExit(f'could not write the checkpoint of step {step} to {tmp}: {e}. The run '
                         f'stopped; the last good checkpoint ({kept}) is as it was. Free space or '
                         f'fix permissions in {out_dir}, then continue with --resume=True')

def prune_checkpoints(step, earlier_run):
    """Keep the newest keep_checkpoints - 1 older files. Drop those of an abandoned later
    history (steps >= step, after resuming from an older one), and at a fresh run's first
    save those an earlier run in out_dir left."""
    older = older_checkpoints()
    keep = [p for s, p in older if s < step and not earlier_run][:keep_checkpoints - 1]
    for _, p in older:
        if p not in keep:
            os.remove(p)

# -----------------------------------------------------------------------------
# reading checkpoints: one clear line for each way a checkpoint cannot be used

class CheckpointError(ValueError):
    """A checkpoint file that cannot be used; the message names it and says why."""

RESUME_KEYS = ('optimizer', 'iter_num', 'rng', 'history')
# what a resumed run keeps from its checkpoint: the recipe, the model's shape, the optimizer
MEMORY_KEYS = ('loss_chunk', 'recompute')  # model_args a resumed run may change (same loss, less memory)
IDENTITY_KEYS = ('recipe', 'model_size', 'block_size', 'n_kv_head', 'optimizer', 'optimizer_states',
                 'attention', 'lora_rank', 'end_blocks')

def read_checkpoint(path):
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

def checkpoint_recipe(ckpt, path):
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

def resume_candidates():
    """(path, older): the checkpoint to continue from (resume_from, else out_dir/ckpt.pt) and
    the older ones to offer if it cannot be used. Nothing at all to resume stops the run."""
    path = resume_from or checkpoint_path()
    newest = os.path.abspath(path) == os.path.abspath(checkpoint_path())
    step = checkpoint_step(path)  # an older one: offer only those older still
    older = [p for s, p in older_checkpoints() if newest or step is not None and s < step]
    if not os.path.exists(path) and not resume_from and not older:
        raise SystemExit(f'--resume=True: nothing to resume from, {path} not found: start a fresh '
                         f'run without --resume, or set --out_dir to the folder of the run')
    return path, older

def resume_checkpoint():
    """(checkpoint, path) to continue from. A file that cannot be used stops the run and
    names the newest older checkpoint to resume instead."""
    path, older = resume_candidates()
    try:
        ckpt = read_checkpoint(path)
        missing = [k for k in RESUME_KEYS if k not in ckpt]
        if missing:
            raise CheckpointError(f"{path} cannot be resumed: no {', '.join(missing)}")
        checkpoint_recipe(ckpt, path)
    except CheckpointError as e:
        hint = (f'resume from the previous checkpoint with --resume_from={older[0]}' if older else
                f'no older checkpoint is kept in {out_dir}: start a fresh run without --resume')
        raise SystemExit(f'{e}; {hint}')
    return ckpt, path

def adopt_checkpoint_config(ckpt, path):
    """A resumed run keeps its checkpoint's recipe, model shape and optimizer (the weights and
    states have them). A flag set to something else is refused, as it could not apply; a
    default that differs gives way to the checkpoint's value, and the log says so."""
    saved = dict(ckpt.get('config', {}), recipe=ckpt['recipe'])
    for key in IDENTITY_KEYS:
        if key not in DEFAULTS or key not in saved or saved[key] == globals()[key]:
            continue
        ours, theirs = globals()[key], saved[key]
        if key in _overrides:
            raise SystemExit(f'{path} was trained with {key}={theirs!r}, but the flags ask for '
                             f'{key}={ours!r}; a resumed run keeps its checkpoint\'s {key}: drop '
                             f'{key}={ours!r} from the command line or config file to continue '
                             f'with {theirs!r}, or give a new --out_dir to start a {key}={ours!r} run')
        log(f"resuming with the checkpoint's {key}={theirs!r} (the default is {ours!r})")
        globals()[key] = theirs
    check_config()  # again, with the checkpoint's values

def load_model_state(model, ckpt, path):
    try:
        model.load_state_dict(ckpt['model'])
    except RuntimeError as e:  # missing or unexpected keys, or other shapes
        raise SystemExit(f"{path}: its weights do not fit the model built from its model_args and "
                         f"recipe {ckpt['recipe']!r} ({' '.join(str(e).split())[:300]}): it was "
                         f"written by another version of the code")

def optimizer_class(optimizer):
    return f'{type(optimizer).__module__}.{type(optimizer).__qualname__}'

def load_optimizer_state(model, optimizer, ckpt, path):
    """The optimizer state, refused if it belongs to another optimizer: torch's
    load_state_dict checks only the parameter counts, and a foreign state would then fail
    (or worse, not fail) in the first step. One written by FSDP2 (keyed by name) is loaded by
    name, each rank keeping its rows of every state (with or without FSDP now)."""
    saved, ours = ckpt.get('optimizer_class'), optimizer_class(optimizer)
    if saved is not None and saved != ours:
        raise SystemExit(f'{path} holds the state of a {saved} optimizer, but this run builds '
                         f'{ours}: resume with the optimizer it was trained with, or give a new '
                         f'--out_dir for a new run')
    try:
        if ckpt['config'].get('fsdp', False):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
            set_optimizer_state_dict(model, _parts(optimizer), ckpt['optimizer'],
                                     options=StateDictOptions(full_state_dict=True))
        else:
            optimizer.load_state_dict(ckpt['optimizer'])
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise SystemExit(f"{path}: its optimizer state does not fit this run's {ours} ({e}): "
                         f"resume with the optimizer it was trained with, or give a new --out_dir")

# -----------------------------------------------------------------------------
# preemption: SIGTERM or SIGUSR1, which clusters send before they stop a job, makes the run
# finish its step, write a checkpoint and exit 0

_stop_signal = None  # the number of the signal received, set by the handler

def _on_stop_signal(signum, frame):
    global _stop_signal
    _stop_signal = signum

def catch_stop_signals():
    """Install the handler; returns the previous handlers, which main() puts back."""
    global _stop_signal
    _stop_signal = None
    sigs = [signal.SIGTERM] + ([signal.SIGUSR1] if hasattr(signal, 'SIGUSR1') else [])
    if threading.current_thread() is not threading.main_thread():
        return {}  # only the main thread may set handlers: signals keep their defaults
    previous = {s: signal.signal(s, _on_stop_signal) for s in sigs}
    for s in sigs:  # restart system calls the signal interrupts (gloo's socket reads, ...),
        signal.siginterrupt(s, False)  # which could fail with EINTR; the flag is all we need
    return previous

def stop_requested():
    """Whether any rank got a stop signal. Signals reach the ranks at different moments, so
    they agree by an all_reduce(MAX) after every step, and all stop after the same one."""
    if not dist.is_initialized():
        return _stop_signal is not None
    flag = torch.tensor([float(_stop_signal is not None)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() > 0

def stop_after_signal(raw_model, optimizer, run):
    """Checkpoint the step just taken (every rank joins in) and say how to continue."""
    write_checkpoint(raw_model, optimizer, run)
    name = signal.Signals(_stop_signal).name if _stop_signal else 'a stop signal on another rank'
    log(f"{name}: stopped after step {run['iter_num'] - 1}, checkpoint {checkpoint_path()}; "
        f"continue with --resume=True")

# -----------------------------------------------------------------------------
# FSDP2 (torch.distributed.fsdp.fully_shard): sharding, mixed precision, whole checkpoints

def shard_model(model):
    """fully_shard each block, then the root (wte, ln_f, lm_head), in place. Every parameter
    becomes a DTensor holding this rank's rows (dim 0, torch.chunk's split); the optimizer,
    built after this, keeps its states on those rows only. Before a block's forward FSDP2
    all-gathers its weights into plain tensors, so FP4Linear quantizes whole weights as it does
    without FSDP; after the block's backward the weight gradients are reduce-scattered.
    Mixed precision replaces autocast here: with dtype='bfloat16' the weights are gathered
    and used in BF16 (half the bytes of FP32), activations between blocks are BF16 too (under
    autocast they stay FP32), and gradients are reduced in FP32; the sharded weights and the
    optimizer stay FP32. With dtype='float32' nothing is cast.
    Each rank initialised its own model (seeded seed + rank); rank 0's weights are broadcast
    into every rank's shards, as DDP does at its start."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(device.split(':')[0], (dist.get_world_size(),))
    param_dtype = torch.bfloat16 if dtype == 'bfloat16' else None
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    whole = model.state_dict() if dist.get_rank() == 0 else {}
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True,
                                                                broadcast_from_rank0=True))
    return model

def _whole():
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 gets it, on the CPU

def full_state_dicts(model, optimizer):
    """(model, optimizer) state dicts for ckpt.pt. With FSDP2 both are gathered from every
    rank's shard (a collective: every rank calls this; ranks other than 0 get {}): the model's
    is a plain state_dict, as without FSDP; the optimizer's is keyed by parameter name
    (torch.distributed.checkpoint's format, one dict for all of optim.Optimizers' parts),
    which any world size can load."""
    if not fsdp:
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    return (get_model_state_dict(model, options=_whole()),
            get_optimizer_state_dict(model, _parts(optimizer), options=_whole()))

def _parts(optimizer):
    """The torch optimizers inside optim.build's result (optim.Optimizers), or the one given."""
    return getattr(optimizer, 'parts', optimizer)

def check_resume_fsdp(ckpt):
    """An optimizer state written without FSDP (keyed by position) cannot be sharded."""
    if fsdp and not ckpt['config'].get('fsdp', False):
        raise configurator.ConfigError(f'{out_dir}/ckpt.pt was written with fsdp=False: '
                                       'resume it with --fsdp=False')

def on_whole_matrix(fn, t):
    """fn (e.g. Newton-Schulz, SPEC 8.2) applied to the whole matrix of FSDP2's shard t, and this
    rank's rows of the result, as a DTensor placed like t: every rank all-gathers t, runs fn
    (redundantly, the same on every rank) and keeps its rows. A plain tensor: fn(t). For an
    optimizer whose update mixes rows, which a shard alone cannot compute (README, FSDP2)."""
    from torch.distributed.tensor import DTensor, Replicate
    if not isinstance(t, DTensor):
        return fn(t)
    whole = DTensor.from_local(fn(t.full_tensor()), t.device_mesh, [Replicate()] * t.device_mesh.ndim,
                               run_check=False)
    return whole.redistribute(t.device_mesh, t.placements)  # Replicate -> Shard: no communication

# -----------------------------------------------------------------------------
# one optimizer step

class LossOf(torch.nn.Module):
    """model(x, y)'s loss alone, as a module: make_graphed_callables finds the parameters through it."""
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        return self.model(x, y)[1]

def graphed(model, data, ctx):
    """cuda_graph=True: model's training forward and backward captured as two CUDA graphs
    (torch.cuda.make_graphed_callables) and replayed each micro-step, without the host's launch
    work: the FP4 layers run eagerly between the compiled graph's pieces, at ~2 ms of host time a
    layer (README, Speed). A model-like callable (x, y) -> (None, loss): every replay copies its
    x, y into the graph's inputs and writes the same output tensor, so the loss is read before the
    next micro-step. The three warmup runs (on a sample batch) take autograd.grad, not backward:
    they leave the parameters' .grad alone, but draw random numbers. The stochastic-rounding seeds
    are drawn on the GPU, so each replay rounds afresh. Clipping, the finite check and the
    optimizer step stay eager, after the graphs: a non-finite loss still stops before the step."""
    x, y = get_batch(data['train'], (0, 0, 0))
    t0 = time.time()
    with ctx:
        # allow_unused_input: a parameter the loss does not reach gets no gradient rather than an error
        fn = torch.cuda.make_graphed_callables(LossOf(model), (x, y), num_warmup_iters=3, allow_unused_input=True)
    log(f'cuda_graph: forward and backward captured as CUDA graphs in {time.time() - t0:.1f} s')
    # The backward graph hands out the same gradient buffers each replay. Into a .grad that is None,
    # autograd may store such a buffer itself, which the next micro-step's replay then overwrites:
    # with accumulation, the step would get twice the last micro-step's gradient (measured on the
    # H200). A .grad that exists is added to in place, so the gradients stay allocated (train_step
    # zeroes them instead of freeing them; a parameter the loss does not reach gets zeros, not None).
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    return Graphed(model, fn)

class Graphed(torch.nn.Module):
    """graphed()'s result: model's parameters (for clipping) and a forward that replays the graphs."""
    def __init__(self, model, fn):
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self, x, y):
        return None, self.fn(x, y)

def train_step(model, optimizer, data, it, accum, rank, ctx):
    """Forward/backward over accum micro-batches, clip, check, step. Returns (loss, norm).
    Stops the run (SystemExit, non-zero) before the optimizer step if the loss or the
    gradient norm is not finite, so the weights and the last checkpoint stay good."""
    loss_sum = torch.zeros((), device=device)
    for micro in range(accum):
        if isinstance(model, DDP):
            model.require_backward_grad_sync = micro == accum - 1  # all-reduce once, at the end
        x, y = get_batch(data['train'], (0, it, rank * accum + micro))
        loss = forward_loss(model, x, y, ctx)
        if it == debug_nan_step:
            loss = loss * float('nan')
        (loss / accum).backward()
        loss_sum += loss.detach().float()
    clip = grad_clip if grad_clip > 0 else float('inf')
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    loss = loss_sum / accum
    if dist.is_initialized():
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # every rank decides alike below
    loss, norm = loss.item(), norm.item()
    if not (math.isfinite(loss) and math.isfinite(norm)):
        raise SystemExit(f'non-finite loss ({loss}) or gradient norm ({norm}) at step {it}: '
                         f'stopped before the optimizer step; {out_dir}/ckpt.pt is the last good state')
    optimizer.step()
    optimizer.zero_grad(set_to_none=not isinstance(model, Graphed))  # graphed(): why
    return loss, norm

# -----------------------------------------------------------------------------
# the run

def setup(argv):
    """Apply overrides, start DDP, pick the device. Returns (rank, world_size, ctx)."""
    global device, _log_path, _overrides
    globals().update(DEFAULTS)  # fresh defaults each call: main() may run twice in a process
    _overrides = configurator.configure(DEFAULTS, argv)
    globals().update(_overrides)
    if resume_from:
        globals()['resume'] = True
    check_config()
    if resume:
        resume_candidates()  # nothing to resume: say so now, before preparing any data
    rank, local_rank, world = init_distributed()
    if world > 1 and device.startswith('cuda'):
        device = f'cuda:{local_rank}'
        torch.cuda.set_device(device)
    if gradient_accumulation_steps % world:
        raise configurator.ConfigError(f'gradient_accumulation_steps={gradient_accumulation_steps} '
                                       f'must be divisible by the {world} ranks')
    _log_path = None
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        _log_path = os.path.join(out_dir, 'train.log')
    torch.manual_seed(seed + rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    if fsdp and not dist.is_initialized():
        raise configurator.ConfigError('fsdp=True needs torchrun (a process group), e.g. '
                                       'torchrun --standalone --nproc_per_node=2 train.py --fsdp=True')
    if fsdp and optimizer in ('adamw_fp4', 'root_fp4'):  # their FP4 code takes plain tensors
        raise configurator.ConfigError(f'fsdp=True does not run optimizer={optimizer!r} yet: its NVFP4 '
                                       'states/Newton-Schulz need the wiring in README, FSDP2')
    # FSDP2 casts the weights itself (MixedPrecisionPolicy, see shard_model): no autocast
    ctx = (nullcontext() if dtype == 'float32' or fsdp else  # a graph capture needs autocast's cache off
           torch.autocast(device_type=device.split(':')[0], dtype=torch.bfloat16, cache_enabled=not cuda_graph))
    return rank, world, ctx

def init_run(rank, data_meta):
    """Model, optimizer, start step and loss history: fresh, or from out_dir/ckpt.pt."""
    global _resumed_step
    ckpt, _resumed_step = None, None
    if resume:
        ckpt, path = resume_checkpoint()
        adopt_checkpoint_config(ckpt, path)
        model_args = ckpt['model_args']  # the checkpoint's shape wins over the config's
        # how the loss and the backward are computed, not what is trained: a flag may change them
        model_args.update({k: globals()[k] for k in MEMORY_KEYS if k in _overrides})
        if data_meta['vocab_size'] > model_args['vocab_size']:
            raise SystemExit(f"the data's vocabulary ({data_meta['vocab_size']} tokens, meta.json "
                             f"of {data_dir or dataset}) is larger than the model's "
                             f"({model_args['vocab_size']}, {path}): the checkpoint was trained "
                             f"with another tokenizer; resume it on its own dataset")
    else:
        vocab = 128 * math.ceil(data_meta['vocab_size'] / 128)  # pad: GEMM-friendly
        model_args = asdict(config_for(model_size, vocab_size=vocab, block_size=block_size,
                                       n_kv_head=n_kv_head, lora_rank=lora_rank, end_blocks=end_blocks,
                                       attention=attention, loss_chunk=loss_chunk, recompute=recompute))
    model = build_model(model_args)
    if ckpt:
        check_resume_fsdp(ckpt)
        load_model_state(model, ckpt, path)  # the whole model, on every rank, before sharding
    if fsdp:
        shard_model(model)  # moves each rank's shard to the device: no whole copy stays there
    else:
        model.to(device)
    opt = build_optimizer(model)  # (the global `optimizer` names it)
    history = dict(steps=[], train_loss=[], val_steps=[], val_loss=[], eval_train_loss=[])
    iter_num = 0
    if ckpt:
        load_optimizer_state(model, opt, ckpt, path)
        iter_num, history = ckpt['iter_num'], ckpt['history']
        if os.path.abspath(path) == os.path.abspath(checkpoint_path()):
            _resumed_step = iter_num  # kept as ckpt.<step>.pt when the next one replaces it
        rngs = ckpt['rng']
        set_rng_states(rngs[rank] if rank < len(rngs) else rngs[0])
    return model, model_args, opt, iter_num, history

def finish(history, stats, model_args, model=None, meta=None):
    """Loss plot, summary.json and the one-line summary a device run collects; then a short
    sample of what the model writes, and where the files are."""
    plot_losses(history, os.path.join(out_dir, 'loss.png'))
    split = history.get('val_split') or (None, 0)
    summary = dict(val_loss=history['val_loss'][-1] if history['val_loss'] else None,
                   val_loss_split=split[0], val_split_tokens=split[1],
                   tokens_per_s=stats['tokens_per_s'], peak_mem_gib=peak_mem_gib(),
                   recipe=recipe, optimizer=optimizer, model_size=model_size, model_args=model_args,
                   optimizer_state_bytes=stats['optimizer_state_bytes'],
                   iters=max_iters, tokens=stats['tokens'], wall_s=stats['wall_s'],
                   device=torch.cuda.get_device_name() if device.startswith('cuda') else 'cpu',
                   loss_curve=history)
    with open(os.path.join(out_dir, 'summary.json'), 'w') as f:
        json.dump(summary, f, indent=1)
    log(f"val_loss={summary['val_loss']:.4f} tokens_per_s={summary['tokens_per_s']:.0f} "
        f"peak_mem_gib={summary['peak_mem_gib']:.3f}"
        + (f" val_loss_split={split[0]:.4f}" if split[0] is not None else ''))
    if model is not None and sample_tokens > 0:
        show_sample(model, meta)
    log(f"loss plot: {os.path.join(out_dir, 'loss.png')}, summary: "
        f"{os.path.join(out_dir, 'summary.json')}, checkpoint: {checkpoint_path()}")
    return summary

def show_sample(model, meta):
    """What the model writes after 'def ', so the first run shows what it learned."""
    import sample  # generation lives there; imported here, as sample.py imports train
    text = sample.generate_text(model, meta, 'def ', 1, sample_tokens, seed=seed)[0]
    log(f'--- a sample ({sample_tokens} tokens after "def "; more: python sample.py '
        f'--out_dir={out_dir}) ---\n{text}\n---')

def plot_losses(history, path):
    try:
        import matplotlib
        matplotlib.use('Agg')  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        log('matplotlib not installed: no loss.png')
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(history['steps'], history['train_loss'], lw=0.8, label='train (each step)')
    ax.plot(history['val_steps'], history['val_loss'], 'o-', label='val')
    ax.set(xlabel='step', ylabel='loss', title=f'{model_size}, recipe {recipe}')
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

def eval_and_checkpoint(model, raw_model, optimizer, data, ctx, run):
    """Eval both splits; then save model, optimizer, RNG states and data position."""
    rank, world, it = run['rank'], run['world'], run['iter_num']
    losses = estimate_loss(model, data, ctx, rank)
    history = run['history']
    history['val_steps'].append(it)
    history['val_loss'].append(losses['val'])
    history['eval_train_loss'].append(losses['train'])
    history.setdefault('val_loss_se', []).append(losses['val_se'])  # setdefault: older checkpoints
    log(f"step {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
    if not always_save_checkpoint or it == run['start_iter']:
        return  # nothing new to save
    write_checkpoint(raw_model, optimizer, run)

def write_checkpoint(raw_model, optimizer, run):
    """Gather every rank's RNG states; rank 0 saves model, optimizer, RNGs and data position."""
    rank, world, it = run['rank'], run['world'], run['iter_num']
    rngs = [rng_states()]
    if world > 1:
        rngs = [None] * world  # every rank's RNG, so each resumes its own stream
        dist.all_gather_object(rngs, rng_states())
    model_state, optimizer_state = full_state_dicts(raw_model, optimizer)  # every rank: FSDP2 gathers
    if rank == 0:
        # data position = the step: get_batch is a pure function of (seed, step)
        save_checkpoint(dict(model=model_state, optimizer=optimizer_state,
                             model_args=run['model_args'], recipe=recipe, iter_num=it,
                             config=run['config'], rng=rngs, history=run['history'],
                             data=dict(sampler='seed+step', seed=seed, step=it),
                             optimizer_class=optimizer_class(optimizer), meta=run['meta']),
                        run['saved_step'])
        prune_checkpoints(it, earlier_run=run['saved_step'] is None and not run['resumed'])
    run['saved_step'] = it

def main(argv=None):
    t_start = time.time()
    rank, world, ctx = setup(sys.argv[1:] if argv is None else argv)
    config = {k: globals()[k] for k in config_keys}
    if rank == 0:
        log_header(config)
    data, meta = load_data(rank == 0)
    epochs = max_iters * batch_size * block_size * gradient_accumulation_steps / len(data['train'])
    if epochs > 1:
        log(f'warning: the run repeats its training data: {max_iters} steps read {epochs:.2f} epochs '
            f"of the {len(data['train']):,}-token train split")
    first_refit = min(lora_refit_first, lora_refit_interval) if lora_refit_first > 0 else lora_refit_interval
    if recipe == 'fullstack' and lora_rank != -1 and lora_refit_interval <= 0:
        log(f'warning: lora_refit_interval {lora_refit_interval}: L is never fitted, so it stays 0 '
            '(the low-rank part does nothing; --lora_rank=-1 says so)')
    elif recipe == 'fullstack' and lora_rank != -1 and 1 < max_iters <= first_refit:
        every = max(1, max_iters // 8)
        log(f'warning: L (LoRA-SVD) is fitted at step 0, to the initial weights, and never refit: max_iters '
            f'{max_iters}, lora_refit_interval {lora_refit_interval}, lora_refit_first {lora_refit_first}. '
            f'The trained W soon has other top directions (README: "How stale L gets"); '
            f'--lora_refit_interval={every} refits it every {every} steps ({(max_iters - 1) // every} refits)')
    if eval_split_tokens > 0:
        split_batches(len(data['val']), world)  # fail now, not after the run
    raw_model, model_args, optimizer, iter_num, history = init_run(rank, meta)
    log(f"model {model_size} {model_args}: {raw_model.get_num_params() / 1e6:.2f}M non-embedding, "
        f"{raw_model.get_num_params(False) / 1e6:.2f}M total parameters; recipe {recipe} "
        f"(blocks {fp4_blocks(raw_model.config.n_layer, recipe, raw_model.config.end_blocks)}), optimizer {config['optimizer']}")
    model = torch.compile(raw_model, mode=compile_mode) if compile else raw_model
    if cuda_graph and world > 1:
        raise configurator.ConfigError(f'cuda_graph=True runs one process; this run has {world} (DDP/FSDP)')
    if world > 1 and not fsdp:  # FSDP2 wrapped raw_model in place in init_run
        ids = [torch.cuda.current_device()] if device.startswith('cuda') else None
        model = DDP(model, device_ids=ids)
    train_model = graphed(model, data, ctx) if cuda_graph else model  # evals run `model`
    run = dict(rank=rank, world=world, start_iter=iter_num, iter_num=iter_num, history=history,
               model_args=model_args, config={k: globals()[k] for k in config_keys}, meta=meta,
               saved_step=_resumed_step, resumed=resume)  # config: with the checkpoint's recipe
    accum = gradient_accumulation_steps // world  # each rank does its share of micro-steps
    tokens_per_step = batch_size * block_size * gradient_accumulation_steps
    decay_iters = lr_decay_iters if lr_decay_iters > 0 else max_iters
    warmup = warmup_iters if warmup_iters >= 0 else int(0.1 * decay_iters)
    tokens, train_time, step_ema = 0, 0.0, None
    previous_handlers = catch_stop_signals()
    try:
        while True:
            # eval and checkpoint before the step; a resumed run has its first eval already
            # (unless a stop signal's checkpoint came between two evals)
            at_eval = iter_num % eval_interval == 0 or iter_num == max_iters
            if at_eval and history['val_steps'][-1:] != [iter_num]:
                eval_and_checkpoint(model, raw_model, optimizer, data, ctx, run)
            if iter_num >= max_iters:
                if eval_split_tokens > 0:
                    history['val_split'] = split_loss(model, data['val'], ctx, rank, world)
                    log(f"step {iter_num}: val loss over the first {history['val_split'][1]:,} "
                        f"val tokens (the same for every seed) {history['val_split'][0]:.4f}")
                break
            lr = get_lr(iter_num, warmup, decay_iters)
            for group in optimizer.param_groups:
                group['lr'] = lr
            if recipe == 'fullstack' and lora_refit_due(iter_num, lora_refit_interval, lora_refit_first):
                import fp4  # L = the top-r part of W, fixed until the next refit (SPEC.md 8.4)
                n_refit = fp4.refit_lora(raw_model, seed=iter_num)
                log(f'step {iter_num}: LoRA-SVD refit of {n_refit} linears')
            t0 = time.time()
            loss, norm = train_step(train_model, optimizer, data, iter_num, accum, rank, ctx)
            dt = time.time() - t0
            history['steps'].append(iter_num)
            history['train_loss'].append(loss)
            if iter_num > run['start_iter']:  # the first step compiles and warms up: not timed
                tokens, train_time = tokens + tokens_per_step, train_time + dt
            step_ema = dt if step_ema is None else 0.9 * step_ema + 0.1 * dt
            if iter_num % log_interval == 0:
                eta = step_ema * (max_iters - iter_num - 1) / 60
                log(f'step {iter_num}/{max_iters} | loss {loss:.4f} | lr {lr:.2e} | norm {norm:.2f} | '
                    f'{tokens_per_step / dt:,.0f} tok/s | {dt * 1000:.0f} ms | '
                    f'mem {peak_mem_gib():.2f} GiB | eta {eta:.1f} min')
            iter_num = run['iter_num'] = iter_num + 1
            if stop_requested():
                return stop_after_signal(raw_model, optimizer, run)
    finally:
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
        # DDP's wrapper holds the process group: drop it (and train_model, which is it without
        # cuda_graph) while the group is up rather than at return, after it is destroyed (a 2-rank
        # gloo run hung now and then right at that return; with train_model kept, every time)
        model = train_model = None
        if dist.is_initialized():
            dist.destroy_process_group()
    stats = dict(tokens=tokens, tokens_per_s=tokens / train_time if train_time else 0.0,
                 wall_s=time.time() - t_start, optimizer_state_bytes=optim.state_bytes(optimizer))
    sampler = None if fsdp else raw_model  # FSDP's shards need every rank: sample.py then
    return finish(history, stats, model_args, sampler, meta) if rank == 0 else None

if __name__ == '__main__':
    try:
        main()
    except configurator.ConfigError as e:
        sys.exit(f'config error: {e}')
