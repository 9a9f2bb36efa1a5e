"""
distributed.py: what train.py needs to run on several processes. torchrun starts the ranks; each
either holds the whole model (DDP, wrapped in train.py) or its rows of every parameter (FSDP2,
shard_model below). Also the stop signals a cluster sends before it ends a job: every rank
finishes the same step, the run checkpoints and exits 0.

$ torchrun --standalone --nproc_per_node=8 train.py config/quartet_30m.py             # DDP
$ torchrun --standalone --nproc_per_node=8 train.py config/llama_1b.py --fsdp=True    # FSDP2
"""
import math
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
    """The torch optimizers inside muon.build's result (muon.Optimizers), or the one given."""
    return getattr(optimizer, 'parts', optimizer)

# ---------------------------------------------------------------------------------------------
# optimizers on FSDP2's shards (optim.py, muon.py): which rows a rank holds, states placed like them, and
# whole matrices for the updates a shard alone cannot compute


def is_sharded(t):
    """Whether t is a DTensor (an FSDP2 parameter, its gradient, or a state placed like them)."""
    if not dist.is_available():  # a torch build without torch.distributed has no DTensors
        return False
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def local(t):
    """This rank's part of a DTensor (a view: writing to it writes the DTensor), or t itself."""
    return t.to_local() if is_sharded(t) else t


def shard_of(t):
    """Rows(t) for an FSDP2 parameter (or its gradient), None for a plain tensor."""
    return Rows(t) if is_sharded(t) else None


def row_counts(n, world):
    """Rows each rank holds of a dim 0 of n rows: torch.chunk's split, which FSDP2 uses (chunks of
    ceil(n / world) rows; the last ranks may hold fewer, or none)."""
    c = -(-n // world)
    return [max(0, min(c, n - r * c)) for r in range(world)]


class Rows:
    """The rows of a tensor that FSDP2 gives this rank (Shard(0) on a 1-D mesh). shape: the whole
    tensor's; counts: every rank's row count; start, rows: this rank's first row and count."""

    def __init__(self, t):
        from torch.distributed.tensor import Shard
        if t.device_mesh.ndim != 1 or tuple(t.placements) != (Shard(0),):
            raise ValueError(f'a sharded optimizer state follows FSDP2\'s Shard(0) on a 1-D device mesh; '
                             f'this parameter is placed {tuple(t.placements)} on a {t.device_mesh.ndim}-D mesh')
        self.mesh, self.group = t.device_mesh, t.device_mesh.get_group()
        self.world, self.rank = t.device_mesh.size(), t.device_mesh.get_local_rank()
        self.shape = tuple(t.shape)
        self.counts = row_counts(self.shape[0], self.world)
        self.start, self.rows = sum(self.counts[:self.rank]), self.counts[self.rank]
        if t.to_local().shape[0] != self.rows:
            raise ValueError(f'rank {self.rank} holds {t.to_local().shape[0]} rows of {self.shape}, '
                             f'not torch.chunk\'s {self.rows}: not an FSDP2 shard')

    def amax(self, a):
        """a (this shard's amax, 0-d) -> the max over every rank's shard (an all-reduce)."""
        a = a.clone()
        dist.all_reduce(a, op=dist.ReduceOp.MAX, group=self.group)
        return a

    def wrap(self, t):
        """t (this rank's rows of a state of shape (self.shape[0], ...)) as a DTensor placed like
        the parameter: what torch.distributed.checkpoint saves, and reshards at another world size."""
        from torch.distributed.tensor import DTensor, Shard
        shape = torch.Size((self.shape[0], *t.shape[1:]))
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        return DTensor.from_local(t, self.mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)


def on_whole_matrices(fn, shards, rows):
    """This rank's rows of fn(i, whole matrix i) for every i, where shards[i] is this rank's rows of
    matrix i and rows[i] its Rows. For an update that mixes rows (Newton-Schulz, SPEC 8.2), which a
    shard alone cannot compute. The matrices are spread over the ranks, as the published Muon and
    Dion implementations do: matrix i goes to rank i % world, which gathers it, runs fn once and
    sends every rank its rows of the result: two all_to_all calls per `world` matrices, each matrix
    computed on one rank. fn's result is cast to the shards' dtype (they share one)."""
    out = []
    for start in range(0, len(shards), rows[0].world if shards else 1):
        out += _one_each(fn, shards, rows, range(start, min(start + rows[0].world, len(shards))))
    return out


def _one_each(fn, shards, rows, batch):
    """on_whole_matrices for at most one matrix per rank: batch[r] belongs to rank r."""
    world, rank, group = rows[0].world, rows[0].rank, rows[0].group
    mine = batch[rank] if rank < len(batch) else None
    to_owner = [shards[i].numel() for i in batch] + [0] * (world - len(batch))  # my rows of each
    cols = math.prod(rows[mine].shape[1:]) if mine is not None else 0
    from_ranks = [n * cols for n in rows[mine].counts] if mine is not None else [0] * world
    like = shards[batch[0]]
    whole = like.new_empty(sum(from_ranks))
    dist.all_to_all_single(whole, torch.cat([shards[i].reshape(-1) for i in batch]), from_ranks, to_owner,
                           group=group)
    result = whole if mine is None else fn(mine, whole.view(rows[mine].shape)).to(like.dtype)
    back = like.new_empty(sum(to_owner))
    dist.all_to_all_single(back, result.contiguous().reshape(-1), to_owner, from_ranks, group=group)
    return [piece.view(shards[i].shape) for i, piece in zip(batch, back.split(to_owner[:len(batch)]))]

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
