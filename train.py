"""
Pretraining with FP4 linear layers, nanoGPT-style: config globals, then one loop.

$ python train.py                          # prepares data/pycode if needed, trains a small model
$ python train.py --recipe=nvfp4 --max_iters=500
$ python train.py config/quartet_30m.py --resume=True
$ torchrun --standalone --nproc_per_node=8 train.py config/llama_1b.py --fsdp=True  # sharded

Recipes (SPEC.md 5): bf16, quartet (MXFP4), nvfp4, quartet2, fullstack (+ LoRA-SVD, SPEC.md 8.4).
Writes to out_dir: train.log (config, versions, GPU, every step), ckpt.pt, loss.png, summary.json.
"""

import contextlib
import importlib.util
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint
import configurator
import corpus
import distributed
import fp4
import linear
import lora
import muon
import newton_schulz
import optim
import runlog
import selfcheck
from runlog import log
from model import (ATTENTIONS, END_BLOCKS, GPT, GPTConfig, RECIPES, RECOMPUTES, SIZES, Graphed, apply_recipe,
                   config_for, fp4_blocks, fp4_switch_step, graphed, schedule_problem, shape_problem, to_bf16_gemms)

# -----------------------------------------------------------------------------
# config: every global here can be overridden by config/*.py and --key=value
# I/O
out_dir = 'out'
log_interval = 1
always_save_checkpoint = True  # at every eval
resume = False            # continue from out_dir/ckpt.pt, bit-exact on CPU
resume_from = ''          # continue from this checkpoint file instead (implies resume)
keep_checkpoints = 2      # keep the newest N: ckpt.pt, then ckpt.<step>.pt for the older ones
checkpoint_steps = ''     # also checkpoint before these steps ('1221,1373'), evals or not: study.py branches BF16 tails there
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
fp4_until = 1.0           # FP4 GEMMs before step round(fp4_until * max_iters), BF16 from it to the end (model.fp4_switch_step)
end_blocks = 'auto'       # one of model.END_BLOCKS: 'bf16' keeps the first and last blocks in BF16 (nvfp4's rule), 'fp4' runs them FP4 too
attention = 'bf16'        # one of model.ATTENTIONS: 'nvfp4' is FP4 attention (attention.py), any recipe
loss_chunk = 0            # > 0: cross-entropy over the lm_head this many tokens at a time (the logits never whole)
recompute = 'none'        # one of model.RECOMPUTES: 'mlp' reruns ln_2 -> gate_up -> SwiGLU in the backward (less memory)
# AdamW and the lr schedule (Quartet's: betas (0.9, 0.95), wd 0.1, clip 1, cosine, 10% warmup)
optimizer = 'adamw'  # adamw | adamw_fp4 | muon | root | root_fp4 (muon.build)
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
compile_mode = 'default'  # torch.compile's mode; the CUDA-graph ones (reduce-overhead) are refused: docs/speed.md
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
    # tokens: 160 steps of 8 x 64 (82K tokens) at a peak lr of 1e-2 (docs/training.md: time, loss)
    model_size = 'tiny'
    block_size = 64
    batch_size = 8
    gradient_accumulation_steps = 1
    max_iters = 160
    learning_rate = 1e-2
    eval_interval = 40
    eval_iters = 2

COMPILE_MODES = ('default', 'reduce-overhead', 'max-autotune', 'max-autotune-no-cudagraphs')
# the rule of every key above, checked before any data or model is loaded (check_config):
# a value outside it stops the run with one line naming the key, the value and what is allowed
_C = configurator
RULES = dict(
    out_dir=_C.Text(r'[^\x00]+', 'a folder name'), log_interval=_C.Int(1), always_save_checkpoint=_C.Flag(),
    resume=_C.Flag(), resume_from=_C.Text(r'[^\x00]*', 'a checkpoint file, or empty'), keep_checkpoints=_C.Int(1),
    checkpoint_steps=_C.Text(r'(\d+(,\d+)*)?', 'steps, comma-separated'), fp4_until=_C.Float(0, 1, lo_open=True),
    sample_tokens=_C.Int(0), eval_split_tokens=_C.Int(0, note='0: none'),
    dataset=_C.Text(r'[\w.-]+', 'a folder name under data/'), data_dir=_C.Text(r'[^\x00]*', 'a folder, or empty'),
    n_kv_head=_C.Int(0, note='0: as many as query heads'), recipe=_C.Choice(*RECIPES),
    lora_rank=_C.Int(-1, note='-1: none, 0: the default rule'), lora_refit_interval=_C.Int(0, note='0: never'),
    lora_refit_first=_C.Int(0, note='0: none'), end_blocks=_C.Choice(*END_BLOCKS), attention=_C.Choice(*ATTENTIONS),
    loss_chunk=_C.Int(0, note='0: the whole logits'), recompute=_C.Choice(*RECOMPUTES),
    optimizer=_C.Choice(*muon.OPTIMIZERS), ns_precision=_C.Choice('', *newton_schulz.NS_PRECISIONS),
    optimizer_states=_C.Choice('', *muon.ROOT_STATES), weight_decay=_C.Float(0), beta1=_C.Float(0, 1, hi_open=True),
    beta2=_C.Float(0, 1, hi_open=True), grad_clip=_C.Float(0, note='0: no clipping'),
    warmup_iters=_C.Int(-1, note='-1: 10% of lr_decay_iters'), lr_decay_iters=_C.Int(-1, note='-1 or 0: max_iters'),
    min_lr_frac=_C.Float(0, 1), device=_C.Text(r'cpu|cuda(:\d+)?', "'cpu', 'cuda' or 'cuda:N'"),
    dtype=_C.Choice('float32', 'bfloat16'), compile=_C.Flag(), compile_mode=_C.Choice(*COMPILE_MODES),
    fsdp=_C.Flag(), cuda_graph=_C.Flag(), seed=_C.Int(0, 2**32 - 1), debug_nan_step=_C.Int(-1),
    model_size=_C.Choice(*SIZES), block_size=_C.Int(1), batch_size=_C.Int(1), gradient_accumulation_steps=_C.Int(1),
    max_iters=_C.Int(1), learning_rate=_C.Float(0, lo_open=True), eval_interval=_C.Int(1), eval_iters=_C.Int(1),
)
config_keys = [k for k, v in globals().items()
               if not k.startswith('_') and isinstance(v, (int, float, bool, str))]
DEFAULTS = {k: globals()[k] for k in config_keys}
HERE = os.path.dirname(os.path.abspath(__file__))
CUDA_GRAPH_MODES = ('reduce-overhead', 'max-autotune')  # refused by check_config: measured to fail here
_overrides = {}   # the keys that config files and --key=value set, set in setup()
_resumed_step = None  # the step of the out_dir/ckpt.pt this run resumed from, set in init_run()

# -----------------------------------------------------------------------------
# setup: checks, distributed, logging

def check_config():
    """Each key against its rule (RULES), then the combinations that cannot run together."""
    configurator.check({k: globals()[k] for k in config_keys}, RULES)
    if recipe == 'float8' and importlib.util.find_spec('torchao') is None:
        raise configurator.ConfigError("recipe 'float8' is torchao's float8 training, and torchao is not "
                                       "installed: pip install torchao")
    try:  # ns_precision / optimizer_states against the optimizer, before any model is built
        muon.build(torch.nn.Linear(16, 16), optimizer, ns=ns_precision or None, states=optimizer_states or None)
    except ValueError as e:
        raise configurator.ConfigError(f'optimizer={optimizer!r} with ns_precision={ns_precision!r} '
                                       f'optimizer_states={optimizer_states!r}: {e}')
    if compile and compile_mode in CUDA_GRAPH_MODES:
        raise configurator.ConfigError(
            f'compile_mode={compile_mode!r} (CUDA graphs) fails in train.py: the first backward after an '
            'eval reads activations that a later graph replay overwrote (PyTorch issues 152887, 169545). '
            "Use 'default' or 'max-autotune-no-cudagraphs', or --cuda_graph=True (docs/speed.md)")
    if cuda_graph and not device.startswith('cuda'):
        raise configurator.ConfigError(f'cuda_graph=True needs a CUDA device, got device={device!r}')
    if cuda_graph and recompute != 'none':
        raise configurator.ConfigError(f"cuda_graph=True with recompute={recompute!r}: the recompute's checkpoint "
                                       "saves and restores the GPU's RNG state, which a CUDA graph capture forbids")
    if device.startswith('cuda') and not torch.cuda.is_available():
        raise configurator.ConfigError(f'device={device!r}, but torch finds no CUDA device here: use --device=cpu')
    if lr_decay_iters > 0 and warmup_iters > lr_decay_iters:
        raise configurator.ConfigError(f'warmup_iters={warmup_iters} is longer than lr_decay_iters={lr_decay_iters}')
    problem = (shape_problem(model_size, n_kv_head, recipe, batch_size, block_size)
               or schedule_problem(fp4_until, max_iters, recipe, cuda_graph))
    if problem:
        raise configurator.ConfigError(problem)

# -----------------------------------------------------------------------------
# data

def load_data(master):
    """Memmaps of the train and val tokens, and meta.json (corpus.py checks them)."""
    return corpus.load(data_dir or os.path.join(HERE, 'data', dataset), dataset, bool(data_dir), block_size,
                       master, log)

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
    """muon.build: AdamW, or Muon/ROOT on the 2-D hidden weights and AdamW on the rest. One
    learning_rate and schedule for both: the Muon family's update is scaled to AdamW's RMS
    (muon.update_scale 'rms', docs/fullstack.md, 'Muon and ROOT')."""
    return muon.build(model, optimizer, lr=learning_rate, weight_decay=weight_decay, betas=(beta1, beta2),
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
    seed and run, so the seeds' spread is the training's alone (study/study.py, docs/accuracy.md).
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

def get_lr(it, warmup, decay_iters):
    """Linear warmup, then cosine down to learning_rate * min_lr_frac."""
    min_lr = learning_rate * min_lr_frac
    if it < warmup:
        return learning_rate * (it + 1) / (warmup + 1)
    if it >= decay_iters:
        return min_lr
    ratio = (it - warmup) / max(1, decay_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)

# -----------------------------------------------------------------------------
# resuming: a run keeps its checkpoint's recipe, model shape and optimizer

# what a resumed run keeps from its checkpoint: the recipe, the model's shape, the optimizer
IDENTITY_KEYS = ('recipe', 'model_size', 'block_size', 'n_kv_head', 'optimizer', 'optimizer_states',
                 'attention', 'lora_rank', 'end_blocks')
MEMORY_KEYS = ('loss_chunk', 'recompute')  # model_args a resumed run may change (same loss, less memory)

def adopt_checkpoint_config(ckpt, path):
    """A resumed run keeps its checkpoint's recipe, model shape and optimizer (the weights and
    states have them). A flag set to something else is refused, as it could not apply; a
    default that differs gives way to the checkpoint's value, and the log says so."""
    saved = dict(ckpt.get('config', {}), recipe=ckpt['recipe'])
    for key in IDENTITY_KEYS + (() if 'fp4_until' in _overrides else ('fp4_until',)):  # a flag may move a switch
        if key not in DEFAULTS or key not in saved or saved[key] == globals()[key]:  # still ahead: checkpoint.bf16_from
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

def check_resume_fsdp(ckpt, path):
    """Without FSDP an optimizer state is keyed by position (no sharding it); a sharded checkpoint is FSDP2's."""
    if fsdp and not ckpt['config'].get('fsdp', False):
        raise configurator.ConfigError(f'{path} was written with fsdp=False: resume it with --fsdp=False')
    if not fsdp and checkpoint.is_sharded(path):
        raise configurator.ConfigError(f'{path} is sharded: resume it with --fsdp=True under torchrun (any number of '
                                       f'processes, 1 too), or make one file of it: {checkpoint.to_one_file(path)}')

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
    global device, _overrides
    globals().update(DEFAULTS)  # fresh defaults each call: main() may run twice in a process
    _overrides = configurator.configure(DEFAULTS, argv)
    globals().update(_overrides)
    if resume_from:
        globals()['resume'] = True
    check_config()
    if resume:
        checkpoint.resume_candidates(out_dir, resume_from)  # nothing to resume: say so now, before preparing any data
    rank, local_rank, world = distributed.init(device)
    if world > 1 and device.startswith('cuda'):
        device = f'cuda:{local_rank}'
        torch.cuda.set_device(device)
    if gradient_accumulation_steps % world:
        raise configurator.ConfigError(f'gradient_accumulation_steps={gradient_accumulation_steps} '
                                       f'must be divisible by the {world} ranks')
    runlog.open_log(None)
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        runlog.open_log(os.path.join(out_dir, 'train.log'))
    torch.manual_seed(seed + rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    if fsdp and not dist.is_initialized():
        raise configurator.ConfigError('fsdp=True needs torchrun (a process group), e.g. '
                                       'torchrun --standalone --nproc_per_node=2 train.py --fsdp=True')
    # FSDP2 casts the weights itself (MixedPrecisionPolicy, see shard_model): no autocast
    ctx = (nullcontext() if dtype == 'float32' or fsdp else  # a graph capture needs autocast's cache off
           torch.autocast(device_type=device.split(':')[0], dtype=torch.bfloat16, cache_enabled=not cuda_graph))
    return rank, world, ctx

def init_run(rank, data_meta):
    """Model, optimizer, start step and loss history: fresh, or from out_dir/ckpt.pt."""
    global _resumed_step
    ckpt, _resumed_step = None, None
    if resume:
        ckpt, path = checkpoint.read_for_resume(out_dir, resume_from)
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
        check_resume_fsdp(ckpt, path)
        checkpoint.load_model_state(model, ckpt, path)  # the whole model, on every rank, before sharding
        if checkpoint.bf16_from(ckpt, path, fp4_until, max_iters) is not None:  # switched before it: BF16 on
            to_bf16_gemms(model)
    if fsdp:
        distributed.shard_model(model, device, dtype)  # moves each rank's shard to the device: no whole copy stays there
    else:
        model.to(device)
    opt = build_optimizer(model)  # (the global `optimizer` names it)
    history = dict(steps=[], train_loss=[], val_steps=[], val_loss=[], eval_train_loss=[])
    iter_num = 0
    if ckpt:
        checkpoint.load_optimizer_state(model, opt, ckpt, path)
        iter_num, history = ckpt['iter_num'], ckpt['history']
        if os.path.abspath(path) == os.path.abspath(checkpoint.newest(out_dir)):
            _resumed_step = iter_num  # kept as ckpt.<step>.pt when the next one replaces it
        rngs = ckpt['rng']
        checkpoint.set_rng_states(rngs[rank] if rank < len(rngs) else rngs[0], device.startswith('cuda'))
    return model, model_args, opt, iter_num, history

def finish(history, stats, model_args, model=None, meta=None):
    """Loss plot, summary.json and the one-line summary a device run collects; then a short
    sample of what the model writes, and where the files are."""
    runlog.plot_losses(history, os.path.join(out_dir, 'loss.png'), f'{model_size}, recipe {recipe}')
    split = history.get('val_split') or (None, 0)
    summary = dict(val_loss=history['val_loss'][-1], val_loss_split=split[0], val_split_tokens=split[1],
                   tokens_per_s=stats['tokens_per_s'], peak_mem_gib=runlog.peak_mem_gib(device),
                   recipe=recipe, optimizer=optimizer, model_size=model_size, model_args=model_args,
                   optimizer_state_bytes=stats['optimizer_state_bytes'], bf16_from=history.get('bf16_from'),
                   iters=max_iters, tokens=stats['tokens'], wall_s=stats['wall_s'],
                   device=torch.cuda.get_device_name() if device.startswith('cuda') else 'cpu',
                   selfcheck=selfcheck.summary(), loss_curve=history)
    runlog.write_summary(out_dir, summary)
    if model is not None and sample_tokens > 0:
        show_sample(model, meta)
    log(f"loss plot: {os.path.join(out_dir, 'loss.png')}, summary: "
        f"{os.path.join(out_dir, 'summary.json')}, checkpoint: {checkpoint.newest(out_dir)}")
    return summary

def show_sample(model, meta):
    """What the model writes after 'def ', so the first run shows what it learned."""
    import sample  # generation: only when a run ends with a sample
    text = sample.generate_text(model, meta, 'def ', 1, sample_tokens, seed=seed)[0]
    log(f'--- a sample ({sample_tokens} tokens after "def "; more: python sample.py '
        f'--out_dir={out_dir}) ---\n{text}\n---')

def eval_and_checkpoint(model, raw_model, optimizer, data, ctx, run):
    """Eval both splits; then save model, optimizer, RNG states and data position."""
    rank, it = run['rank'], run['iter_num']
    losses = estimate_loss(model, data, ctx, rank)
    history = run['history']
    history['val_steps'].append(it)
    history['val_loss'].append(losses['val'])
    history['eval_train_loss'].append(losses['train'])
    history.setdefault('val_loss_se', []).append(losses['val_se'])  # setdefault: older checkpoints
    log(f"step {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
    if not (math.isfinite(losses['train']) and math.isfinite(losses['val'])):
        raise SystemExit(f"non-finite eval loss at step {it} (train {losses['train']}, val {losses['val']}): "
                         f"stopped without saving; {checkpoint.newest(out_dir)} is the last good state")
    if not always_save_checkpoint or it == run['start_iter']:
        return  # nothing new to save
    write_checkpoint(raw_model, optimizer, run)

def write_checkpoint(raw_model, optimizer, run):
    """Gather every rank's RNG states; save model, optimizer, RNGs and data position: rank 0 one
    file, or with FSDP2 every rank its shards (checkpoint.save_sharded)."""
    rank, world, it = run['rank'], run['world'], run['iter_num']
    mine = checkpoint.rng_states(device.startswith('cuda'))
    rngs = [mine] if world == 1 else [None] * world  # every rank's RNG, so each resumes its own stream
    if world > 1:
        dist.all_gather_object(rngs, mine)
    model_state, optimizer_state = checkpoint.state_dicts(raw_model, optimizer, fsdp)  # FSDP2: this rank's shards
    # data position = the step: get_batch is a pure function of (seed, step)
    state = dict(model=model_state, optimizer=optimizer_state, model_args=run['model_args'], recipe=recipe,
                 iter_num=it, config=run['config'], rng=rngs, history=run['history'],
                 data=dict(sampler='seed+step', seed=seed, step=it),
                 optimizer_class=checkpoint.optimizer_class(optimizer), meta=run['meta'])
    if fsdp or rank == 0:  # FSDP2: every rank writes its shards
        (checkpoint.save_sharded if fsdp else checkpoint.save)(state, out_dir, keep_checkpoints, run['saved_step'], log)
    if rank == 0:
        checkpoint.prune(out_dir, it, keep_checkpoints, earlier_run=run['saved_step'] is None and not run['resumed'])
    run['saved_step'] = it

def main(argv=None):
    t_start = time.time()
    rank, world, ctx = setup(sys.argv[1:] if argv is None else argv)
    config = {k: globals()[k] for k in config_keys}
    if rank == 0:
        runlog.header(config, fp4.backends() if recipe not in ('bf16', 'float8') else None)
        selfcheck.attach(log)  # each accelerated path's first-use check, and any fallback, in the log
    data, meta = load_data(rank == 0)
    epochs = max_iters * batch_size * block_size * gradient_accumulation_steps / len(data['train'])
    if epochs > 1:
        log(f'warning: the run repeats its training data: {max_iters} steps read {epochs:.2f} epochs '
            f"of the {len(data['train']):,}-token train split")
    if recipe == 'fullstack' and lora_rank != -1 and (
            warning := lora.lora_schedule_warning(max_iters, lora_refit_interval, lora_refit_first)):
        log(f'warning: {warning}')
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
    train_model = model  # evals run `model`
    if cuda_graph:  # replay forward and backward as CUDA graphs (model.graphed)
        t0 = time.time()
        train_model = graphed(model, *get_batch(data['train'], (0, 0, 0)), ctx)
        log(f'cuda_graph: forward and backward captured as CUDA graphs in {time.time() - t0:.1f} s')
    run = dict(rank=rank, world=world, start_iter=iter_num, iter_num=iter_num, history=history,
               model_args=model_args, config={k: globals()[k] for k in config_keys}, meta=meta,
               saved_step=_resumed_step, resumed=resume)  # config: with the checkpoint's recipe
    accum = gradient_accumulation_steps // world  # each rank does its share of micro-steps
    tokens_per_step = batch_size * block_size * gradient_accumulation_steps
    decay_iters = lr_decay_iters if lr_decay_iters > 0 else max_iters
    warmup = warmup_iters if warmup_iters >= 0 else int(0.1 * decay_iters)
    switch_at, save_steps = fp4_switch_step(fp4_until, max_iters), {int(s) for s in checkpoint_steps.split(',') if s}
    tokens, train_time, step_ema = 0, 0.0, None
    previous_handlers = distributed.catch_stop_signals()
    try:
        while True:
            # eval and checkpoint before the step; a resumed run has its first eval already
            # (unless a stop signal's checkpoint came between two evals)
            at_eval = iter_num % eval_interval == 0 or iter_num == max_iters
            if at_eval and history['val_steps'][-1:] != [iter_num]:
                eval_and_checkpoint(model, raw_model, optimizer, data, ctx, run)
            if iter_num in save_steps and run['saved_step'] != iter_num and iter_num != run['start_iter']:
                write_checkpoint(raw_model, optimizer, run)  # a branch point (study.py), before any switch below
            if iter_num >= max_iters:
                if eval_split_tokens > 0:
                    history['val_split'] = split_loss(model, data['val'], ctx, rank, world)
                    log(f"step {iter_num}: val loss over the first {history['val_split'][1]:,} "
                        f"val tokens (the same for every seed) {history['val_split'][0]:.4f}")
                break
            if iter_num >= switch_at and 'bf16_from' not in history:  # BF16 from s = round(fp4_until * max_iters),
                history['bf16_from'] = iter_num  # after s's eval (FP4's); optimizer, states, data, lr go on as they were
                log(f'step {iter_num}: fp4_until={fp4_until}: {to_bf16_gemms(raw_model)} block linears run BF16 from here')
            lr = get_lr(iter_num, warmup, decay_iters)
            for group in optimizer.param_groups:
                group['lr'] = lr
            if (recipe == 'fullstack' and 'bf16_from' not in history  # BF16 linears use no L: no refit
                    and lora.lora_refit_due(iter_num, lora_refit_interval, lora_refit_first)):
                # L = the top-r part of W, fixed until the next refit (SPEC.md 8.4)
                n_refit = linear.refit_lora(raw_model, seed=iter_num)
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
                    f'mem {runlog.peak_mem_gib(device):.2f} GiB | eta {eta:.1f} min')
            iter_num = run['iter_num'] = iter_num + 1
            if distributed.stop_requested(device):
                write_checkpoint(raw_model, optimizer, run)  # the step just taken; every rank joins in
                log(f'{distributed.stop_signal_name()}: stopped after step {iter_num - 1}, checkpoint '
                    f'{checkpoint.newest(out_dir)}; continue with --resume=True')
                return None
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
