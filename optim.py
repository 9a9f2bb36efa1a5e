"""
AdamW for FP4 pretraining (SPEC.md 8.1) and the FP4 (NVFP4) optimizer states it keeps: the state
quantizer, AdamW with FP32 or NVFP4 states, and its fused GPU step with that step's self-check.
The Muon family (Muon, ROOT) and build(), which picks each parameter's optimizer, are muon.py's;
ROOT can keep its momentum in these states too.

Read top to bottom: the FP4 state quantizer (and state_bytes, what any optimizer's state holds),
AdamW, then the fused kernel path.
"""
import math
import os

import torch

import distributed
import formats
import fp4
import cuda_kernels as kernels
import selfcheck  # the fused kernel's first-use check (below)

# ---------------------------------------------------------------------------------------------
# FP4 optimizer states (SPEC 8.1): the quantizer AdamW (and muon.py's ROOT) stores its states with
#
# Contract (used by AdamW and by ROOT's optional NVFP4 momentum):
#   quantize_state(x, kind, seed) -> an object holding the packed state (kind 'signed' for a first
#       moment / momentum, 'sqrt' for a second moment stored as sqrt(v)); it is what state_dict()
#       holds; dequantize_state(s) -> FP32 tensor of x's shape; state_nbytes(s) -> bytes it holds.
#
# The packed state is a plain dict (so torch.save / torch.load(weights_only=True) take it):
#   format 'nvfp4', kind, shape (x's), hadamard n, rounding, mean_over (the mean's granularity);
#   codes uint8 (R, K/2) and scales uint8 (R, K/16) of fp4.quantize's NVFP4 QTensor of the (R, K)
#   view (K = x's last dim), tensor_scale FP32 0-d; 'sqrt' also holds mean, FP32: (R, K/128) per
#   128-block, (R, 1) per row or (1, 1) per tensor (none: a zero (1, 1)).
# Tensors that stay FP32 (quantizable() is False: fewer than 2 dims, under STATE_MIN_NUMEL
# elements, last dim not divisible by 16, the Hadamard size or the mean's block) are an FP32
# tensor instead of a dict.
# Under FSDP2 (a DTensor parameter, sharded along dim 0) each rank holds the packed state of its
# rows only, as DTensors placed like the parameter (codes, scales, row or block means; shape is the
# whole tensor's): blocks run along the last dim, so rows stay whole blocks and a checkpoint
# reshards them at another world size without requantizing. The tensor scale is taken from the
# whole tensor's amax (one all-reduce) and SR draws from each element's index in the whole tensor,
# so a sharded step computes, bit for bit, the rows the unsharded step computes.
#
# 'signed' (m):  q = NVFP4(x H);                 x' = dequantize(q) H
# 'sqrt'   (v):  s = sqrt(v), mu = mean(s),      v' = (clamp(dequantize(q) H + mu, min=0))^2
#                q = NVFP4((s - mu) H)
# H is the blockwise Hadamard of fp4.hadamard (symmetric, H H = I up to FP32 rounding). The mean
# per 128-block is a halving-tree sum (fp4._tree_sum) times 1/128, as a kernel adds it.
# Defaults decided by measurement (docs/fullstack.md, "Optimizer states in FP4"; python study/measure.py
# --sections states): no Hadamard and no mean (both cost update accuracy: Adam divides each element
# by its own sqrt(v), and a rotation or a mean spreads a block's error onto its small elements),
# stochastic rounding for m (RN stalls an EMA), round to nearest for sqrt(v) (SR's noise, squared,
# biases v up).

STATE_HADAMARD = 0
STATE_ROUNDING = ("sr", "rn")  # (m, v)
STATE_MEAN = "none"
MEAN_BLOCK = 128  # mean 'block': one FP32 mean of sqrt(v) per 128 elements (0.031 B/param)
STATE_MIN_NUMEL = 4096  # smaller tensors (biases, norms, tiny layers) stay FP32: bytes negligible
STATE_KINDS = ("signed", "sqrt")
STATE_MEANS = ("block", "row", "tensor", "none")


def quantizable(shape, hadamard=STATE_HADAMARD, mean="none"):
    """Whether a state of this shape is stored in NVFP4 (else FP32): its last dim must hold whole
    NVFP4 blocks, Hadamard blocks and (mean 'block') mean blocks."""
    n = max(hadamard, 16, MEAN_BLOCK if mean == "block" else 0)
    return len(shape) >= 2 and math.prod(shape) >= STATE_MIN_NUMEL and shape[-1] % n == 0


def quantize_state(x, kind="signed", seed=0, rounding=None, hadamard=STATE_HADAMARD, mean=STATE_MEAN,
                   shard=None):
    """x (FP32 state, any shape) -> the packed state (a dict), or an FP32 copy if x stays FP32.
    kind 'signed': x itself (a first moment); 'sqrt': x is a second moment v >= 0, stored as
    sqrt(v) minus its mean. seed drives stochastic rounding (rounding='sr'): use a fresh one at
    every call (AdamW derives it from the step and the parameter). rounding None: STATE_ROUNDING's
    choice for the kind. shard (distributed.Rows of an FSDP2 parameter): x is this rank's rows of
    the state, quantized as those rows of the whole one (the comment above); the result is placed
    like the parameter (DTensors)."""
    if rounding is None and kind in STATE_KINDS:
        rounding = STATE_ROUNDING[kind == "sqrt"]
    _check_state_args(x, kind, rounding, hadamard, mean)
    shape = shard.shape if shard is not None else tuple(x.shape)  # the whole tensor's
    if not quantizable(shape, hadamard, mean if kind == "sqrt" else "none"):
        return _placed(x.detach().float().clone(), shard)
    _check_sharded(shape, mean if kind == "sqrt" else "none", shard)
    k = shape[-1]
    x2 = x.detach().float().reshape(-1, k)  # (R, K)
    packed = dict(format="nvfp4", kind=kind, shape=shape, hadamard=hadamard,
                  rounding=rounding, mean_over=mean if kind == "sqrt" else "none")
    if kind == "sqrt":
        x2 = sqrt_rn(x2)
        mu = _state_mean(x2, mean)
        x2 = _sub_mean(x2, mu)
        packed["mean"] = _placed(mu, shard if mean in ("block", "row") else None)  # per row: sharded
    codes, scales, g = _quantize_rows(x2, rounding, hadamard, seed, shard)
    packed.update(codes=_placed(codes, shard), scales=_placed(scales, shard), tensor_scale=g)
    return packed


def _quantize_rows(x2, rounding, hadamard, seed, shard):
    """(codes, scales, tensor scale) of x2 (R, K) in NVFP4: the whole tensor, or (shard) this rank's
    rows of it with the whole tensor's amax and SR indices (fp4.quantize's amax_reduce, index_offset)."""
    if shard is None:
        q = fp4.quantize(x2, "nvfp4", rounding=rounding, hadamard=hadamard, seed=seed)
        return q.codes, q.scales, q.tensor_scale
    k = x2.shape[1]
    if x2.shape[0] == 0:  # a rank without rows still joins the amax's all-reduce
        u8 = dict(dtype=torch.uint8, device=x2.device)
        return torch.zeros(0, k // 2, **u8), torch.zeros(0, k // 16, **u8), fp4._tensor_scale(x2.new_zeros(1), shard.amax)
    q = fp4.quantize(x2, "nvfp4", rounding=rounding, hadamard=hadamard, seed=seed, amax_reduce=shard.amax,
                     index_offset=shard.start * k)
    return q.codes, q.scales, q.tensor_scale


def _placed(t, shard):
    """t (this rank's rows) as a DTensor placed like the sharded parameter, or t itself."""
    return t if shard is None else shard.wrap(t)


def _check_sharded(shape, mean, shard):
    """A sharded NVFP4 state quantizes whole rows of a 2-D parameter, with row-local means."""
    if shard is None:
        return
    if len(shape) != 2:
        raise ValueError(f"NVFP4 states of a sharded (FSDP2) parameter need 2 dims, so that its rows "
                         f"are whole blocks; got shape {shape}: give it FP32 states (state='fp32')")
    if mean == "tensor":
        raise ValueError("state mean 'tensor' needs the whole tensor, which no rank of a sharded (FSDP2) "
                         "parameter holds: use 'row', 'block' or 'none'")


def dequantize_state(s):
    """The packed state -> FP32 tensor of the original shape (an FP32 state: itself); sharded:
    this rank's rows of it."""
    if isinstance(s, torch.Tensor):
        return distributed.local(s)
    shape, n = s["shape"], s["hadamard"]
    k = shape[-1]
    codes = distributed.local(s["codes"])
    r = codes.shape[0]  # sharded: this rank's rows
    if r == 0:
        return torch.zeros(0, *shape[1:], device=codes.device)
    q = fp4.QTensor(codes, distributed.local(s["scales"]), s["tensor_scale"], "nvfp4", (r, k), 1)
    x2 = fp4.dequantize(q)  # (R, K), rotated
    if n:
        x2 = fp4.hadamard(x2, n)  # H H = I: back to the state's own basis
    if s["kind"] == "sqrt":
        x2 = _add_mean(x2, distributed.local(s["mean"])).clamp_(min=0)  # a negative sqrt(v) would divide by eps
        x2 = x2 * x2
    return x2.view(r * k // math.prod(shape[1:]), *shape[1:])


def state_nbytes(s):
    """Bytes a state holds: codes, scales, tensor scale, mean (or the FP32 tensor); sharded: this
    rank's."""
    if isinstance(s, torch.Tensor):
        s = {"state": s}
    return sum(distributed.local(t).numel() * t.element_size() for t in s.values() if isinstance(t, torch.Tensor))


def state_bytes(optimizer):
    """Bytes the optimizer's state holds (every tensor in optimizer.state; packed FP4 states by
    their codes, scales, tensor scales and means; tensor subclasses such as torchao's quantized
    states by their inner tensors). Parameters and gradients are not counted."""
    return sum(_value_bytes(v) for st in optimizer.state.values() for v in st.values())


def _value_bytes(v):
    if is_packed(v):
        return state_nbytes(v)
    if isinstance(v, torch.Tensor):
        if type(v) is not torch.Tensor and hasattr(v, "__tensor_flatten__"):
            names, _ = v.__tensor_flatten__()
            return sum(_value_bytes(getattr(v, n)) for n in names)
        return v.numel() * v.element_size()
    if isinstance(v, dict):
        return sum(_value_bytes(x) for x in v.values())
    return 0


def sqrt_rn(x):
    """FP32 square root, correctly rounded on every device (through FP64: the double rounding is
    exact for sqrt). torch's CPU float sqrt is not: 17% of random inputs came out 1 ulp off on this
    build (AVX512), which a kernel's __fsqrt_rn would not reproduce."""
    return torch.sqrt(x.double()).float()


def is_packed(s):
    return isinstance(s, dict) and s.get("format") == "nvfp4"


def _check_state_args(x, kind, rounding, hadamard, mean):
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"quantize_state takes a floating-point tensor, got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    if kind not in STATE_KINDS:
        raise ValueError(f"unknown state kind {kind!r}; allowed: {STATE_KINDS}")
    if rounding not in ("rn", "sr"):
        raise ValueError(f"state rounding must be 'rn' or 'sr', got {rounding!r}")
    if hadamard not in (0,) + fp4.HADAMARD_SIZES:
        raise ValueError(f"state hadamard must be 0 or one of {fp4.HADAMARD_SIZES}, got {hadamard!r}")
    if kind == "sqrt" and mean not in STATE_MEANS:
        raise ValueError(f"state mean must be one of {STATE_MEANS}, got {mean!r}")


def _state_mean(s, mean):
    """Mean of sqrt(v) (R, K): per MEAN_BLOCK elements (R, K/128) as a halving-tree sum, per row
    (R, 1), per tensor (1, 1), or none (a zero (1, 1))."""
    if mean == "block":
        return fp4._tree_sum(s.view(s.shape[0], s.shape[1] // MEAN_BLOCK, MEAN_BLOCK)) * (1.0 / MEAN_BLOCK)
    if mean == "row":
        return s.mean(-1, keepdim=True)
    if mean == "tensor":
        return s.mean().view(1, 1)
    return s.new_zeros(1, 1)


def _sub_mean(s, mu):
    if mu.shape[-1] > 1:  # per block: (R, K/128, 128) - (R, K/128, 1)
        return (s.view(s.shape[0], s.shape[1] // MEAN_BLOCK, MEAN_BLOCK) - mu.unsqueeze(-1)).view(s.shape)
    return s - mu


def _add_mean(d, mu):
    if mu.shape[-1] > 1:
        return (d.view(d.shape[0], d.shape[1] // MEAN_BLOCK, MEAN_BLOCK) + mu.unsqueeze(-1)).view(d.shape)
    return d + mu


# ---------------------------------------------------------------------------------------------
# AdamW (SPEC 8.1)
#
# The update is torch.optim.AdamW's (Loshchilov & Hutter, decoupled weight decay; Kingma & Ba's
# bias correction):  p <- p (1 - lr wd) - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
# with m <- b1 m + (1 - b1) g and v <- b2 v + (1 - b2) g^2.
# state='fp32' runs torch's own ops in torch's order: the same numbers as torch.optim.AdamW with
# foreach=False. state='nvfp4' dequantizes both states, updates them in FP32 (one rounding per
# operation, the order a kernel follows), steps the parameter and re-quantizes (quantize_state).
#
# The eps blow-up (SPEC 8.1): exact AdamW has |m_t| <= C_t sqrt(v_t) for every element, by
# Cauchy-Schwarz on m_t = (1 - b1) sum_k b1^k g_(t-k) against v_t = (1 - b2) sum_k b2^k g_(t-k)^2:
#     C_t = (1 - b1) / sqrt(1 - b2) * sqrt(sum_(k<t) (b1^2 / b2)^k),
# so no element of its update exceeds U_t = lr C_t sqrt(1 - b2^t) / (1 - b1^t) (1 at t = 1, 1.165
# for t -> inf at betas (0.9, 0.95)). Quantized states break the invariant: a block's error in m
# over a sqrt(v) rebuilt as ~0 gives m / eps. With ratio_clamp the FP4 path projects m back onto
# |m| <= C_t sqrt(v) (a no-op on exact states), so its updates obey the same bound U_t.

STATE_FORMATS = ("fp32", "nvfp4")


def _run_closure(closure):
    """torch's optimizer contract: step(closure) re-evaluates the loss with gradients on."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class PackedStates:
    """A torch optimizer mixin for states held packed (quantize_state's dicts): AdamW's and
    ROOT's state_dict() hold them as they are (uint8 codes and scales), and load_state_dict keeps
    them so."""

    def load_state_dict(self, state_dict):
        """torch's, but packed FP4 states keep their dtypes (torch casts every tensor of a state to
        the parameter's dtype: uint8 codes would become floats) and move to the parameter's device;
        so do BF16 states (ROOT's momentum)."""
        saved = state_dict["state"]
        packed = {k: {n: v for n, v in s.items() if is_packed(v)} for k, s in saved.items()}
        plain = {k: {n: v for n, v in s.items() if not is_packed(v)} for k, s in saved.items()}
        super().load_state_dict({**state_dict, "state": plain})
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            for name, v in plain.get(i, {}).items():
                if isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16:
                    self.state[p][name] = self.state[p][name].to(torch.bfloat16)
            for name, s in packed.get(i, {}).items():
                self.state[p][name] = {f: v.to(p.device, copy=True) if isinstance(v, torch.Tensor) else v
                                       for f, v in s.items()}


class AdamW(PackedStates, torch.optim.Optimizer):
    """AdamW with FP32 or NVFP4 states. lr, betas, eps, weight_decay: as torch's. state: 'fp32' or
    'nvfp4'. The NVFP4 options: rounding ('rn', 'sr' or a pair: m's, v's), hadamard and mean (as
    quantize_state's), ratio_clamp (the eps blow-up guard above). seed: the base of the SR seeds,
    a pure function of (seed, step, parameter index, state), so resumed runs repeat exactly.
    fused: None uses the fused GPU kernel where it applies (unless FP4_ADAMW_FUSED=0: below),
    False never (the PyTorch reference), True requires it. Every option can be set per param group; tensors quantizable() rejects keep
    FP32 states under 'nvfp4'."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, state="fp32",
                 rounding=STATE_ROUNDING, hadamard=STATE_HADAMARD, mean=STATE_MEAN, ratio_clamp=True,
                 seed=0, fused=None):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, state=state,
                        rounding=rounding, hadamard=hadamard, mean=mean, ratio_clamp=ratio_clamp,
                        fused=fused)
        self.seed = int(seed)
        super().__init__(params, defaults)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_group(group, len(self.param_groups) - 1)

    @torch.no_grad()
    def step(self, closure=None):
        loss = _run_closure(closure)
        index = -1
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                index += 1  # the parameter's position over all groups: part of its SR seeds
                if p.grad is None:
                    continue
                _check_grad(p, gi)
                st = self.state[p]
                if not st:
                    _init_state(p, st, group)
                st["step"] += 1
                if is_packed(st["exp_avg"]):
                    seeds = _state_seeds(self.seed, int(st["step"].item()), index)
                    _adamw_nvfp4(p, st, group, seeds)
                else:
                    _adamw_fp32(p, st, group)
        return loss

    @torch.no_grad()
    def init_state(self):
        """Allocate every parameter's state now (step() does it lazily): for memory accounting,
        e.g. state_bytes() of a model built on the meta device."""
        for group in self.param_groups:
            for p in group["params"]:
                if not self.state[p]:
                    _init_state(p, self.state[p], group)

def _check_group(group, gi):
    where = f"param group {gi}"
    for name in ("lr", "eps", "weight_decay"):
        if not (isinstance(group[name], (int, float)) and group[name] >= 0):
            raise ValueError(f"{where}: {name} must be a number >= 0, got {group[name]!r}")
    betas = group["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0 <= b < 1 for b in betas)):
        raise ValueError(f"{where}: betas must be two numbers in [0, 1), got {betas!r}")
    if group["state"] not in STATE_FORMATS:
        raise ValueError(f"{where}: unknown state format {group['state']!r}; allowed: {STATE_FORMATS}")
    if group["fused"] not in (None, True, False):
        raise ValueError(f"{where}: fused must be None, True or False, got {group['fused']!r}")
    for rounding in _roundings(group):
        _check_state_args(torch.zeros(1), "sqrt", rounding, group["hadamard"], group["mean"])
    for i, p in enumerate(group["params"]):
        if not p.is_floating_point() or p.is_complex():
            raise TypeError(f"{where}, parameter {i}: AdamW needs real floating-point parameters, got {p.dtype}")


def _roundings(group):
    """(m's, v's) rounding: group['rounding'] is one of 'rn', 'sr' or a pair of them."""
    r = group["rounding"]
    if isinstance(r, str):
        return r, r
    if isinstance(r, (tuple, list)) and len(r) == 2:
        return tuple(r)
    raise ValueError(f"rounding must be 'rn', 'sr' or a pair (m, v) of them, got {r!r}")


def _check_grad(p, gi):
    if p.grad.is_sparse:
        raise TypeError(f"param group {gi}: AdamW does not support sparse gradients "
                        f"(parameter of shape {tuple(p.shape)}); use torch.optim.SparseAdam")
    if p.grad.shape != p.shape:
        raise ValueError(f"param group {gi}: gradient of shape {tuple(p.grad.shape)} for a parameter "
                         f"of shape {tuple(p.shape)}")


def _init_state(p, st, group):
    st["step"] = torch.tensor(0.0)  # a CPU FP32 tensor, as torch.optim.AdamW keeps it
    if group["state"] == "nvfp4" and quantizable(tuple(p.shape), group["hadamard"], group["mean"]):
        shard = distributed.shard_of(p)
        _check_sharded(tuple(p.shape), group["mean"], shard)
        st["exp_avg"] = zero_state(p.shape, "signed", group, p.device, shard)
        st["exp_avg_sq"] = zero_state(p.shape, "sqrt", group, p.device, shard)
    else:
        st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def zero_state(shape, kind, group, device, shard=None):
    """quantize_state(zeros) without quantizing: zero codes and scales, tensor scale 1 (fp4's
    rule for an all-zero tensor), zero means. shard: this rank's rows, placed like the parameter."""
    k, n, mean = shape[-1], group["hadamard"], group["mean"]
    r = shard.rows if shard is not None else math.prod(shape) // k
    u8 = dict(dtype=torch.uint8, device=device)
    s = dict(format="nvfp4", kind=kind, shape=tuple(shape), hadamard=n, rounding=_roundings(group)[kind == "sqrt"],
             mean_over=mean if kind == "sqrt" else "none")
    if kind == "sqrt":  # quantize_state's field order too: the mean before the codes
        cols = k // MEAN_BLOCK if mean == "block" else 1
        rows = mean in ("block", "row")
        s["mean"] = _placed(torch.zeros(r if rows else 1, cols, device=device), shard if rows else None)
    s.update(codes=_placed(torch.zeros(r, k // 2, **u8), shard), scales=_placed(torch.zeros(r, k // 16, **u8), shard),
             tensor_scale=torch.ones((), device=device))
    return s


def _state_seeds(base, step, index):
    """SR seeds of a parameter's two states at a step: distinct per (base, step, index, state)."""
    h = formats._lowbias32_py(formats._lowbias32_py(base + 0x9E3779B9 * step) ^ (0x632BE5AB * (index + 1)))
    return h, formats._lowbias32_py(h ^ 0x5851F42D)


def _adamw_fp32(p, st, group):
    """torch.optim.AdamW's single-tensor step, op for op."""
    lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    t = st["step"].item()
    # FSDP2: this rank's rows (every operation is elementwise)
    p, m, v, g = (distributed.local(x) for x in (p, st["exp_avg"], st["exp_avg_sq"], p.grad))
    if wd != 0:
        p.mul_(1 - lr * wd)
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = (v.sqrt() / (1 - b2**t) ** 0.5).add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1 - b1**t))


def ratio_bound(betas, t):
    """C_t: |m_t| <= C_t sqrt(v_t) for exact AdamW states after t steps (the comment above)."""
    b1, b2 = betas
    r = b1 * b1 / b2
    series = t if r == 1 else (1 - r**t) / (1 - r)
    return (1 - b1) / math.sqrt(1 - b2) * math.sqrt(series)


def update_bound(lr, betas, t):
    """U_t: no element of exact AdamW's step t moves by more than this (weight decay aside)."""
    b1, b2 = betas
    return lr * ratio_bound(betas, t) * math.sqrt(1 - b2**t) / (1 - b1**t)


def _f32(x):
    return float(torch.tensor(x, dtype=torch.float32))  # a Python number rounded to FP32


def _nvfp4_scalars(group, t):
    """The FP32 scalars of one NVFP4 step (the kernel takes the same values)."""
    lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    clamp = ratio_bound((b1, b2), t) if group["ratio_clamp"] else math.inf
    return dict(b1=_f32(b1), omb1=_f32(1 - b1), b2=_f32(b2), omb2=_f32(1 - b2), clamp=_f32(clamp),
                bc2_sqrt=_f32((1 - b2**t) ** 0.5), eps=_f32(eps), neg_step=_f32(-lr / (1 - b1**t)),
                decay=_f32(1 - lr * wd))


def _adamw_nvfp4(p, st, group, seeds):
    t = int(st["step"].item())
    c = _nvfp4_scalars(group, t)
    shard = distributed.shard_of(p)  # FSDP2: this rank's rows, through the reference (the kernel takes whole tensors)
    if shard is None and _use_kernel(p, st, group):
        return _adamw_nvfp4_kernel(p, st, group, c, seeds)
    m, v = adamw_nvfp4_reference(distributed.local(p), dequantize_state(st["exp_avg"]),
                                 dequantize_state(st["exp_avg_sq"]), c, distributed.local(p.grad))
    rm, rv = _roundings(group)
    st["exp_avg"] = quantize_state(m, "signed", seeds[0], rounding=rm, hadamard=group["hadamard"], shard=shard)
    st["exp_avg_sq"] = quantize_state(v, "sqrt", seeds[1], rounding=rv, hadamard=group["hadamard"], mean=group["mean"],
                                      shard=shard)


def adamw_nvfp4_reference(p, m, v, c, g=None):
    """One FP32 AdamW step on dequantized states m, v (the fused kernel's twin): updates p in place
    and returns the new FP32 m, v. Every operation rounds once, in this order. g: the gradient
    (default p.grad)."""
    g = (p.grad if g is None else g).float()
    m = m * c["b1"] + g * c["omb1"]
    v = v * c["b2"] + (g * g) * c["omb2"]
    sv = sqrt_rn(v)
    if math.isfinite(c["clamp"]):  # |m| <= C_t sqrt(v), the exact-AdamW invariant
        bound = sv * c["clamp"]  # where(), not min/max: the same signed zeros on every device
        m = torch.where(m > bound, bound, torch.where(m < -bound, -bound, m))
    u = m / (sv / fp4._full(sv, c["bc2_sqrt"]) + c["eps"])  # true divisions (not x * (1/y))
    p.copy_(p.float() * c["decay"] + u * c["neg_step"])
    return m, v


# The fused GPU path: kernels.cu's adamw_nvfp4, launched twice per parameter tensor by
# cuda_kernels.adamw_nvfp4 (pass 1: the new states' amaxes for the NVFP4 tensor scales; pass 0:
# everything else), which checks every argument on the host first.

# fused=None means the kernel wherever it applies; it matches the reference bit for bit in all 12
# formats on the H200 (test_optim.py's GPU tests; results/README.md).
# FP4_ADAMW_FUSED=0 sends None to the PyTorch reference instead (the same bits, ~5x slower at 1B).
FUSED_BY_DEFAULT = os.environ.get("FP4_ADAMW_FUSED", "1") != "0"


def _use_kernel(p, st, group):
    """Whether this parameter's NVFP4 step runs fused (group['fused']: None = where it applies and
    FUSED_BY_DEFAULT). The kernel reads and writes the group's format; a state stored in another
    (the group changed since) goes through the reference, which reads the stored one."""
    if group["fused"] is False or (group["fused"] is None and not FUSED_BY_DEFAULT):
        return False
    ok = (_kernel_device(p) and p.dtype == torch.float32 and p.grad.dtype == torch.float32
          and kernels._aligned(p) and kernels._aligned(p.grad) and group["mean"] in ("block", "none")
          and st["exp_avg"]["hadamard"] == group["hadamard"] and st["exp_avg_sq"]["mean_over"] == group["mean"])
    if group["fused"] and not ok:
        raise ValueError("fused=True needs FP32 contiguous CUDA parameters and gradients, CuPy, and "
                         f"mean 'block' or 'none'; got {p.dtype} on {p.device}, mean {group['mean']!r}")
    # the default (None) is self-checked on first use; fused=True runs the kernel as asked
    return ok and (bool(group["fused"]) or selfcheck.verified("kernel.adamw_nvfp4", p.device))


def _kernel_device(p):
    """Whether p's device runs kernels.cu: CUDA, with CuPy (test_optim's host emulation of the
    kernel says yes on the CPU)."""
    return p.is_cuda and fp4.kernels_enabled()


def _adamw_nvfp4_kernel(p, st, group, c, seeds):
    m, v = st["exp_avg"], st["exp_avg_sq"]
    rm, rv = _roundings(group)
    g_new = kernels.adamw_nvfp4(p, p.grad, m, v, group["hadamard"], rm, rv, c, v["mean_over"] == "block", seeds)
    m["tensor_scale"], v["tensor_scale"] = g_new[0], g_new[1]
    m["rounding"], v["rounding"] = rm, rv  # this step's, as the twin's new states say


def _check_fused_adamw(device):
    """The fused kernel (fused=True on `device`) against the PyTorch twin on the CPU, bit for bit:
    2 steps on a (33, 128) parameter (a tail warp for Hadamard-128), block means, SR, a NaN
    gradient in step 2; the parameter and every packed state field."""
    g = torch.Generator().manual_seed(5)
    init, grads = torch.randn(33, 128, generator=g), torch.randn(2, 33, 128, generator=g) * 1e-2
    grads[1, 3, 7] = float("nan")
    runs = []
    for dev, fused in ((device, True), (torch.device("cpu"), False)):
        p = torch.nn.Parameter(init.clone().to(dev))
        opt = AdamW([p], lr=1e-2, state="nvfp4", hadamard=128, mean="block", fused=fused, seed=3)
        for gr in grads:
            p.grad = gr.to(dev)
            opt.step()
        st = opt.state[p]
        runs.append({"param": p.detach()} | {f"{k} {f}": st[k][f] for k in ("exp_avg", "exp_avg_sq")
                                             for f in ("codes", "scales", "tensor_scale")})
    return [line for name in runs[1] for line in selfcheck.mismatches(runs[0][name].cpu(), runs[1][name], name + " ")]


selfcheck.register(selfcheck.Check(
    "kernel.adamw_nvfp4", _check_fused_adamw, "the PyTorch twin (adamw_nvfp4_reference) on the CPU, bit for bit",
    "the PyTorch twin", lambda d: None if d.type == "cuda" and fp4.kernels_enabled() else "no CUDA device with kernels.cu"))
