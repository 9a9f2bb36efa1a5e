"""
distributed.py: what train.py needs to run on several processes. torchrun starts the ranks; each
either holds the whole model (DDP, wrapped in train.py) or its rows of every parameter (FSDP2,
shard_model below). Also the stop signals a cluster sends before it ends a job: every rank
finishes the same step, the run checkpoints and exits 0.

$ torchrun --standalone --nproc_per_node=8 train.py config/quartet_30m.py             # DDP
$ torchrun --standalone --nproc_per_node=8 train.py config/llama_1b.py --fsdp=True    # FSDP2
"""
import os
import signal
import threading

import torch
import torch.distributed as dist

# ---------------------------------------------------------------------------------------------
# ranks


def init(device):
    """(rank, local_rank, world_size); torchrun sets RANK, LOCAL_RANK and WORLD_SIZE."""
    if int(os.environ.get('RANK', -1)) == -1:
        return 0, 0, 1
    dist.init_process_group(backend='nccl' if device.startswith('cuda') else 'gloo')
    return dist.get_rank(), int(os.environ['LOCAL_RANK']), dist.get_world_size()

# ---------------------------------------------------------------------------------------------
# FSDP2 (torch.distributed.fsdp.fully_shard): sharding, mixed precision, whole state dicts


def shard_model(model, device, dtype):
    """fully_shard each block, then the root (wte, ln_f, lm_head), in place. Every parameter
    becomes a DTensor holding this rank's rows (dim 0, torch.chunk's split); the optimizer,
    built after this, keeps its states on those rows only. Before a block's forward FSDP2
    all-gathers its weights into plain tensors, so FP4Linear quantizes whole weights as it does
    without FSDP; after the block's backward the weight gradients are reduce-scattered.
    Mixed precision replaces autocast here: with dtype='bfloat16' the weights are gathered and
    used in BF16 (half the bytes of FP32), activations between blocks are BF16 too (under
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


def parts(optimizer):
    """The torch optimizers inside optim.build's result (optim.Optimizers), or the one given."""
    return getattr(optimizer, 'parts', optimizer)


def full_state_dicts(model, optimizer, fsdp):
    """(model, optimizer) state dicts for ckpt.pt. With FSDP2 both are gathered from every rank's
    shard (a collective: every rank calls this; ranks other than 0 get {}): the model's is a plain
    state_dict, as without FSDP; the optimizer's is keyed by parameter name (torch.distributed.
    checkpoint's format, one dict for all of optim.Optimizers' parts), which any world size loads."""
    if not fsdp:
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    whole = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 gets it, on the CPU
    return (get_model_state_dict(model, options=whole),
            get_optimizer_state_dict(model, parts(optimizer), options=whole))


def on_whole_matrix(fn, t):
    """fn (e.g. Newton-Schulz, SPEC 8.2) applied to the whole matrix of FSDP2's shard t, and this
    rank's rows of the result, as a DTensor placed like t: every rank all-gathers t, runs fn
    (redundantly, the same on every rank) and keeps its rows. A plain tensor: fn(t). For an
    optimizer whose update mixes rows, which a shard alone cannot compute."""
    from torch.distributed.tensor import DTensor, Replicate
    if not isinstance(t, DTensor):
        return fn(t)
    whole = DTensor.from_local(fn(t.full_tensor()), t.device_mesh, [Replicate()] * t.device_mesh.ndim,
                               run_check=False)
    return whole.redistribute(t.device_mesh, t.placements)  # Replicate -> Shard: no communication

# ---------------------------------------------------------------------------------------------
# preemption: SIGTERM or SIGUSR1, which clusters send before they stop a job, makes the run
# finish its step, write a checkpoint and exit 0

_stop_signal = None  # the number of the signal received, set by the handler


def _on_stop_signal(signum, frame):
    global _stop_signal
    _stop_signal = signum


def catch_stop_signals():
    """Install the handler; returns the previous handlers, which the caller puts back."""
    global _stop_signal
    _stop_signal = None
    sigs = [signal.SIGTERM] + ([signal.SIGUSR1] if hasattr(signal, 'SIGUSR1') else [])
    if threading.current_thread() is not threading.main_thread():
        return {}  # only the main thread may set handlers: signals keep their defaults
    previous = {s: signal.signal(s, _on_stop_signal) for s in sigs}
    for s in sigs:  # restart system calls the signal interrupts (gloo's socket reads, ...),
        signal.siginterrupt(s, False)  # which could fail with EINTR; the flag is all we need
    return previous


def stop_requested(device):
    """Whether any rank got a stop signal. Signals reach the ranks at different moments, so they
    agree by an all_reduce(MAX) after every step, and all stop after the same one."""
    if not dist.is_initialized():
        return _stop_signal is not None
    flag = torch.tensor([float(_stop_signal is not None)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() > 0


def stop_signal_name():
    return signal.Signals(_stop_signal).name if _stop_signal else 'a stop signal on another rank'
