"""
Pretraining with FP4 linear layers, nanoGPT-style: config globals, then one loop.

$ python train.py                          # prepares data/pycode if needed, trains a small model
$ python train.py --recipe=nvfp4 --max_iters=500
$ python train.py config/quartet_30m.py --resume=True
$ torchrun --standalone --nproc_per_node=8 train.py config/quartet_30m.py

Recipes (SPEC.md 5): bf16 (baseline), quartet (MXFP4), nvfp4 (NVIDIA), quartet2 (Quartet II).
Writes to out_dir: train.log (config, versions, GPU, every step), ckpt.pt, loss.png,
summary.json.
"""

import importlib.util
import json
import math
import os
import platform
import random
import resource
import shutil
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import configurator
from model import GPT, GPTConfig, OPTIMIZERS, RECIPES, SIZES, apply_recipe, config_for

# -----------------------------------------------------------------------------
# config: every global here can be overridden by config/*.py and --key=value
# I/O
out_dir = 'out'
log_interval = 1
always_save_checkpoint = True  # at every eval
resume = False            # continue from out_dir/ckpt.pt, bit-exact on CPU
# data
dataset = 'pycode'        # data/<dataset>/{train,val}.bin; pycode is prepared on first use
data_dir = ''             # set to read the .bin files from elsewhere
# model
n_kv_head = 0             # 0: as many kv heads as query heads; fewer: GQA
recipe = 'quartet'        # one of model.RECIPES
# AdamW and the lr schedule (Quartet's: betas (0.9, 0.95), wd 0.1, clip 1, cosine, 10% warmup)
optimizer = 'adamw'       # one of model.OPTIMIZERS: adamw (torch's, FP32 states), adamw_fp4 (NVFP4 states)
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
    # a 2-core CPU: about 3 minutes with data prep. The 128 x 100352 lm_head and the FP4
    # reference quantizers are most of the work, so few tokens a step (4 x 64): many
    # small steps show the loss falling sooner than a few big ones.
    model_size = 'tiny'
    block_size = 64
    batch_size = 4
    gradient_accumulation_steps = 1
    max_iters = 90
    learning_rate = 4e-3
    eval_interval = 30
    eval_iters = 2

config_keys = [k for k, v in globals().items()
               if not k.startswith('_') and isinstance(v, (int, float, bool, str))]
DEFAULTS = {k: globals()[k] for k in config_keys}
HERE = os.path.dirname(os.path.abspath(__file__))
_log_path = None  # out_dir/train.log on the master rank, set in main()

# -----------------------------------------------------------------------------
# setup: checks, distributed, logging

def check_config():
    if recipe not in RECIPES:
        raise configurator.ConfigError(f"unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
    if model_size not in SIZES:
        raise configurator.ConfigError(f"unknown model_size {model_size!r}; "
                                       f"choose one of {', '.join(SIZES)}")
    if optimizer not in OPTIMIZERS:
        raise configurator.ConfigError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    if dtype not in ('float32', 'bfloat16'):
        raise configurator.ConfigError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")

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
    try:
        commit = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=HERE, capture_output=True,
                                text=True, timeout=10).stdout.strip()
        log(f'git commit {commit or "unknown"}')
    except (OSError, subprocess.SubprocessError):
        pass
    if torch.cuda.is_available():
        log(f'GPU: {torch.cuda.get_device_name()} x {torch.cuda.device_count()}, '
            f'CUDA {torch.version.cuda}')
    if shutil.which('nvidia-smi'):
        log(subprocess.run(['nvidia-smi'], capture_output=True, text=True, timeout=30).stdout)
    if recipe != 'bf16':
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
            raise FileNotFoundError(f'{path}/train.bin not found: run data/{dataset}/prepare.py')
        if master:
            log(f'{path}/train.bin not found: preparing the default corpus (Python sources)')
            script = os.path.join(path, 'prepare.py')  # a script, not a package: load by path
            spec = importlib.util.spec_from_file_location('pycode_prepare', script)
            prepare = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(prepare)
            prepare.prepare(path)
        if dist.is_initialized():
            dist.barrier()  # the other ranks wait for the files
    with open(os.path.join(path, 'meta.json')) as f:
        meta = json.load(f)
    data = {s: np.memmap(os.path.join(path, f'{s}.bin'), dtype=np.uint32, mode='r')
            for s in ('train', 'val')}
    for split, arr in data.items():
        if len(arr) <= block_size + 1:
            raise ValueError(f'{split}.bin has {len(arr)} tokens, fewer than block_size + 2')
    return data, meta

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

@torch.no_grad()
def estimate_loss(model, data, ctx, rank):
    """Mean loss over eval_iters fixed batches per split (the same batches every eval).
    fork_rng: eval must not move the training RNG stream (FP4 recipes draw from it), so
    a run stopped at any eval resumes exactly."""
    out = {}
    devices = [torch.cuda.current_device()] if device.startswith('cuda') else []
    with torch.random.fork_rng(devices=devices):
        model.eval()
        for si, split in enumerate(('train', 'val')):
            losses = torch.zeros(eval_iters, device=device)
            for k in range(eval_iters):
                x, y = get_batch(data[split], (1 + si, k, rank))
                with ctx:
                    _, loss = model(x, y)
                losses[k] = loss.float()
            mean = losses.mean()
            if dist.is_initialized():
                dist.all_reduce(mean, op=dist.ReduceOp.AVG)
            out[split] = mean.item()
            # standard error of this rank's mean (independent batches): study.py sets it beside seed noise
            out[f'{split}_se'] = (losses.std() / math.sqrt(eval_iters)).item() if eval_iters > 1 else math.nan
        model.train()
    return out

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

def save_checkpoint(state):
    """Write to a temp file, then rename: a crash mid-write leaves the old checkpoint."""
    path = os.path.join(out_dir, 'ckpt.pt')
    torch.save(state, path + '.tmp')
    os.replace(path + '.tmp', path)

# -----------------------------------------------------------------------------
# one optimizer step

def train_step(model, optimizer, data, it, accum, rank, ctx):
    """Forward/backward over accum micro-batches, clip, check, step. Returns (loss, norm).
    Stops the run (SystemExit, non-zero) before the optimizer step if the loss or the
    gradient norm is not finite, so the weights and the last checkpoint stay good."""
    loss_sum = torch.zeros((), device=device)
    for micro in range(accum):
        if isinstance(model, DDP):
            model.require_backward_grad_sync = micro == accum - 1  # all-reduce once, at the end
        x, y = get_batch(data['train'], (0, it, rank * accum + micro))
        with ctx:
            _, loss = model(x, y)
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
    optimizer.zero_grad(set_to_none=True)
    return loss, norm

# -----------------------------------------------------------------------------
# the run

def setup(argv):
    """Apply overrides, start DDP, pick the device. Returns (rank, world_size, ctx)."""
    global device, _log_path
    globals().update(DEFAULTS)  # fresh defaults each call: main() may run twice in a process
    globals().update(configurator.configure(DEFAULTS, argv))
    check_config()
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
    ctx = (nullcontext() if dtype == 'float32' else
           torch.autocast(device_type=device.split(':')[0], dtype=torch.bfloat16))
    return rank, world, ctx

def init_run(rank, data_meta):
    """Model, optimizer, start step and loss history: fresh, or from out_dir/ckpt.pt."""
    ckpt = None
    if resume:
        ckpt = torch.load(os.path.join(out_dir, 'ckpt.pt'), map_location='cpu', weights_only=False)
        model_args = ckpt['model_args']  # the checkpoint's shape wins over the config's
    else:
        vocab = 128 * math.ceil(data_meta['vocab_size'] / 128)  # pad: GEMM-friendly
        model_args = asdict(config_for(model_size, vocab_size=vocab, block_size=block_size,
                                       n_kv_head=n_kv_head))
    model = build_model(model_args)
    if ckpt:
        model.load_state_dict(ckpt['model'])
    model.to(device)
    opt = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), optimizer)
    history = dict(steps=[], train_loss=[], val_steps=[], val_loss=[], eval_train_loss=[])
    iter_num = 0
    if ckpt:
        saved = ckpt['config'].get('optimizer', 'adamw')
        if saved != optimizer:
            raise configurator.ConfigError(f"{out_dir}/ckpt.pt holds {saved!r} optimizer states, not {optimizer!r}")
        opt.load_state_dict(ckpt['optimizer'])
        iter_num, history = ckpt['iter_num'], ckpt['history']
        rngs = ckpt['rng']
        set_rng_states(rngs[rank] if rank < len(rngs) else rngs[0])
    return model, model_args, opt, iter_num, history

def finish(history, stats, model_args):
    """Loss plot, summary.json and the one-line summary a device run collects."""
    plot_losses(history, os.path.join(out_dir, 'loss.png'))
    summary = dict(val_loss=history['val_loss'][-1] if history['val_loss'] else None,
                   tokens_per_s=stats['tokens_per_s'], peak_mem_gib=peak_mem_gib(),
                   recipe=recipe, optimizer=optimizer, model_size=model_size, model_args=model_args,
                   optimizer_state_bytes=stats['optimizer_state_bytes'],
                   iters=max_iters, tokens=stats['tokens'], wall_s=stats['wall_s'],
                   device=torch.cuda.get_device_name() if device.startswith('cuda') else 'cpu',
                   loss_curve=history)
    with open(os.path.join(out_dir, 'summary.json'), 'w') as f:
        json.dump(summary, f, indent=1)
    log(f"val_loss={summary['val_loss']:.4f} tokens_per_s={summary['tokens_per_s']:.0f} "
        f"peak_mem_gib={summary['peak_mem_gib']:.3f}")
    return summary

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
    rngs = [rng_states()]
    if world > 1:
        rngs = [None] * world  # every rank's RNG, so each resumes its own stream
        dist.all_gather_object(rngs, rng_states())
    if rank == 0:
        # data position = the step: get_batch is a pure function of (seed, step)
        save_checkpoint(dict(model=raw_model.state_dict(), optimizer=optimizer.state_dict(),
                             model_args=run['model_args'], recipe=recipe, iter_num=it,
                             config=run['config'], rng=rngs, history=history,
                             data=dict(sampler='seed+step', seed=seed, step=it)))

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
    raw_model, model_args, optimizer, iter_num, history = init_run(rank, meta)
    log(f"model {model_size} {model_args}: {raw_model.get_num_params() / 1e6:.2f}M non-embedding, "
        f"{raw_model.get_num_params(False) / 1e6:.2f}M total parameters; recipe {recipe}, optimizer {config['optimizer']}")
    model = torch.compile(raw_model) if compile else raw_model
    if world > 1:
        ids = [torch.cuda.current_device()] if device.startswith('cuda') else None
        model = DDP(model, device_ids=ids)
    run = dict(rank=rank, world=world, start_iter=iter_num, iter_num=iter_num, history=history,
               model_args=model_args, config=config)
    accum = gradient_accumulation_steps // world  # each rank does its share of micro-steps
    tokens_per_step = batch_size * block_size * gradient_accumulation_steps
    decay_iters = lr_decay_iters if lr_decay_iters > 0 else max_iters
    warmup = warmup_iters if warmup_iters >= 0 else int(0.1 * decay_iters)
    tokens, train_time, step_ema = 0, 0.0, None
    try:
        while True:
            # eval and checkpoint before the step; a resumed run has its first eval already
            at_eval = iter_num % eval_interval == 0 or iter_num == max_iters
            if at_eval and not (resume and iter_num == run['start_iter']):
                eval_and_checkpoint(model, raw_model, optimizer, data, ctx, run)
            if iter_num >= max_iters:
                break
            lr = get_lr(iter_num, warmup, decay_iters)
            for group in optimizer.param_groups:
                group['lr'] = lr
            t0 = time.time()
            loss, norm = train_step(model, optimizer, data, iter_num, accum, rank, ctx)
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
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    import optim  # bytes of the optimizer's states (packed FP4 states as stored)
    stats = dict(tokens=tokens, tokens_per_s=tokens / train_time if train_time else 0.0,
                 wall_s=time.time() - t_start, optimizer_state_bytes=optim.state_bytes(optimizer))
    return finish(history, stats, model_args) if rank == 0 else None

if __name__ == '__main__':
    try:
        main()
    except configurator.ConfigError as e:
        sys.exit(f'config error: {e}')
