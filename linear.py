"""
The FP4 linear layer (SPEC 5): FP4Linear runs all three GEMMs of a linear layer (forward, input
gradient, weight gradient) on FP4 operands under a recipe, and to_fp4 swaps a model's nn.Linear
modules for it. Built on fp4.py's quantizers and GEMM backends (fp4.py never imports this file).

Read top to bottom: the recipes (how every operand of the three GEMMs is quantized), the forward
and backward as custom ops (torch.compile sees through them) with their eager twin, the layer
and to_fp4, then the LoRA-SVD wiring of the fullstack recipe (SPEC 8.4; the SVD itself: lora.py).
"""
import torch

import cuda_kernels as kernels  # the rotate_back kernel (kernels.cu through CuPy)
import fp4
from formats import DeviceSeed, DeviceSigns, EDEN_GROUP, FORMATS, QTensor, random_signs
from lora import lora_rank_for, randomized_svd

# ---------------------------------------------------------------------------------------------
# The recipes (SPEC 5): all three GEMMs of a linear layer in FP4

# How each operand of each GEMM is quantized. Forward: Y = Q(X) Q(W)^T (contraction over K).
# Backward: dgrad dX = E W (contraction over N), wgrad dW = E^T X (contraction over M, tokens);
# "requant" re-quantizes the forward's saved FP4 tensor along the other axis, "transpose" reuses
# 16x16-tile codes as they are. The two operands of a GEMM share their random Hadamard signs.
_Q, _SR32 = dict(scale_rule="quest", rounding="rn", hadamard=32), dict(rounding="sr", hadamard=32)
_EDEN = dict(rounding="eden", hadamard=128)
RECIPES = {
    "bf16": None,  # plain nn.Linear, for comparison
    "quartet": dict(fmt="mxfp4", x=_Q, w=_Q, dgrad_e=_SR32, dgrad_w=_SR32, wgrad_e=_SR32,
                    wgrad_x=_SR32, rotate_back=32),
    "nvfp4": dict(fmt="nvfp4", x=dict(), w=dict(block2d=True), dgrad_e=dict(rounding="sr"),
                  dgrad_w="transpose", wgrad_e=dict(rounding="sr", hadamard=16),
                  wgrad_x=dict(rounding="rn", hadamard=16), rotate_back=0),
    "quartet2": dict(fmt="nvfp4", x=dict(scale_rule="four_over_six"), w=dict(scale_rule="four_over_six"),
                     dgrad_e=_EDEN, dgrad_w=_EDEN, wgrad_e=_EDEN, wgrad_x=_EDEN, rotate_back=0),
    # Full-Stack FP4 (SPEC 8.4): these FP4 GEMMs run on R = W - L (see "LoRA-SVD" below). The
    # backward is quartet2's: lower gradient error than nvfp4's treatment, measured (docs/fullstack.md, LoRA-SVD)
    "fullstack": dict(fmt="nvfp4", x=dict(scale_rule="four_over_six"), w=dict(scale_rule="four_over_six"),
                      dgrad_e=_EDEN, dgrad_w=_EDEN, wgrad_e=_EDEN, wgrad_x=_EDEN, rotate_back=0),
}


def _recipe(name):
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; allowed: {list(RECIPES)}")
    return RECIPES[name]


def _dim_multiple(recipe):
    """What every GEMM dim (in, out and tokens) must be divisible by under a recipe (not cached:
    a few lookups, and torch.compile traces through it without a warning)."""
    r = _recipe(recipe)
    if r is None:
        return 1
    specs = [r[k] for k in ("x", "w", "dgrad_e", "dgrad_w", "wgrad_e", "wgrad_x") if isinstance(r[k], dict)]
    return max([FORMATS[r["fmt"]]] + [s.get("hadamard", 0) for s in specs] +
               [EDEN_GROUP for s in specs if s.get("rounding") == "eden"])


def _flat(q):
    """QTensor -> (codes, scales, mask, tensor_scale) with (fresh) empty tensors for None."""
    dev = q.codes.device
    mask = q.mask if q.mask is not None else torch.empty(0, dtype=torch.uint8, device=dev)
    ts = q.tensor_scale if q.tensor_scale is not None else torch.empty(0, device=dev)
    return q.codes, q.scales, mask, ts


def _unflat(codes, scales, mask, ts, fmt, shape):
    return QTensor(codes, scales, ts if ts.numel() else None, fmt, tuple(shape), 1,
                   mask if mask.numel() else None)


def _linear_fwd_impl(x, w, recipe, out_dtype):
    """Y (M, N) = Q(X) Q(W)^T for X (M, K), W (N, K); also returns the FP4 tensors the backward
    re-quantizes (codes, scales, mask, tensor scale of X, then of W) instead of BF16 copies."""
    r = RECIPES[recipe]
    fold = fp4.mm_backend(r["fmt"], x.device) == "fp8"  # the kernels emit the fp8 operands directly
    qx = fp4.quantize(x, r["fmt"], fold=fold, **r["x"])
    qw = fp4.quantize(w, r["fmt"], fold=fold, **r["w"])
    return (fp4.mm(qx, qw, out_dtype),) + _flat(qx) + _flat(qw)


# torch.compile sees the linear layer as two custom ops (opaque, no graph breaks); eager mode
# calls the same functions through an autograd.Function, which dispatches faster.
@torch.library.custom_op("fp4::linear_fwd", mutates_args=())
def _linear_fwd(x: torch.Tensor, w: torch.Tensor, recipe: str, out_dtype: torch.dtype) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _linear_fwd_impl(x, w, recipe, out_dtype)


@_linear_fwd.register_fake
def _(x, w, recipe, out_dtype):
    r, (m, k), n = RECIPES[recipe], x.shape, w.shape[0]
    bs, masked = FORMATS[r["fmt"]], r["x"].get("scale_rule") == "quest"
    def saved(rows):
        u8 = dict(dtype=torch.uint8)
        mask = x.new_empty(rows, k // 8, **u8) if masked else x.new_empty(0, **u8)
        ts = x.new_empty((), dtype=torch.float32) if r["fmt"] == "nvfp4" else x.new_empty(0, dtype=torch.float32)
        return x.new_empty(rows, k // 2, **u8), x.new_empty(rows, k // bs, **u8), mask, ts
    return (x.new_empty(m, n, dtype=out_dtype),) + saved(m) + saved(n)


@torch.library.custom_op("fp4::linear_bwd", mutates_args=())
def _linear_bwd(e: torch.Tensor, xc: torch.Tensor, xs: torch.Tensor, xm: torch.Tensor, xg: torch.Tensor,
                wc: torch.Tensor, ws: torch.Tensor, wm: torch.Tensor, wg: torch.Tensor, recipe: str,
                x_dtype: torch.dtype, w_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _linear_bwd_impl(e, xc, xs, xm, xg, wc, ws, wm, wg, recipe, x_dtype, w_dtype)


def _linear_bwd_impl(e, xc, xs, xm, xg, wc, ws, wm, wg, recipe, x_dtype, w_dtype):
    """dX = E Q(W) and dW = E^T Q(X), both GEMMs on FP4 operands. Fresh seeds and Hadamard signs
    on every call: with the kernels, one seed drawn on the GPU (torch's CUDA generator; the
    kernels read it and derive the signs: no host sync, and CUDA-graph replays stay random),
    else from torch's CPU generator. Checkpoints hold both generators' states."""
    r = RECIPES[recipe]
    (m, n), k = e.shape, xc.shape[1] * 2
    qx = _unflat(xc, xs, xm, xg, r["fmt"], (m, k))
    qw = _unflat(wc, ws, wm, wg, r["fmt"], (n, k))
    if e.is_cuda and fp4.kernels_enabled():  # drawn on the GPU: graph-safe, no host sync
        seed = DeviceSeed(torch.randint(0, 2**31 - 1, (1,), device=e.device, dtype=torch.int32))
    else:
        seed = int(torch.randint(0, 2**31 - 1, ()).item())
    dx = _grad_gemm(e, qw, r, "dgrad", seed, axis=1)  # (M, K): contraction over N
    dw = _grad_gemm(e, qx, r, "wgrad", seed + 1, axis=0)  # (N, K): contraction over M
    if r["rotate_back"]:  # quartet: straight-through with the clip mask, then undo the rotation
        dx, dw = _rotate_back(dx, qx, r["rotate_back"]), _rotate_back(dw, qw, r["rotate_back"])
    return dx.to(x_dtype), dw.to(w_dtype)


def _rotate_back(d, q, n):
    """(dL/d(XH) * m) H^T (SPEC 5): the straight-through estimator with QuEST's clip mask, then
    the inverse rotation (H is symmetric), computed in FP32 and rounded to d's dtype. On a GPU
    one kernel does it in one pass (rotate_back in kernels.cu), bit for bit; elsewhere, or where
    its self-check failed, fp4.rotate_back_reference."""
    if d.is_cuda and q.mask is not None and n % 32 == 0 and fp4._kernel_ok(d.device, "rotate_back"):
        return kernels.rotate_back(d, q.mask, n)
    return fp4.rotate_back_reference(d, q, n)


@_linear_bwd.register_fake
def _(e, xc, xs, xm, xg, wc, ws, wm, wg, recipe, x_dtype, w_dtype):
    k = xc.shape[1] * 2
    return e.new_empty(e.shape[0], k, dtype=x_dtype), e.new_empty(e.shape[1], k, dtype=w_dtype)


def _grad_gemm(e, saved, r, which, seed, axis):
    """One backward GEMM: E quantized along `axis` (N for dgrad, M for wgrad) against the saved
    forward operand re-quantized along the same dim, with shared random signs."""
    fmt, spec_e, spec_s = r["fmt"], r[which + "_e"], r[which + ("_w" if which == "dgrad" else "_x")]
    n = spec_e.get("hadamard", 0)
    if not n:
        signs = None
    elif isinstance(seed, DeviceSeed):
        signs = DeviceSigns(n, seed)  # derived in the kernels from the device seed
    else:
        signs = random_signs(n, seed)  # host signs: no device copy either way
    qe = fp4.quantize(e, fmt, axis=axis, seed=seed, signs=signs, fold=fp4.mm_backend(fmt, e.device) == "fp8", **spec_e)
    if spec_s == "transpose":
        qs = fp4.transpose_2d(saved)
    else:
        qs = fp4.requantize(saved, fmt, seed=seed + 7919, signs=signs, **spec_s)
    return fp4.mm(qe, qs, e.dtype)


def _linear_setup(ctx, inputs, output):
    x, w, recipe, _ = inputs
    ctx.recipe, ctx.x_dtype, ctx.w_dtype = recipe, x.dtype, w.dtype
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(*output[1:])


def _linear_backward(ctx, grad_y, *_):
    dx, dw = _linear_bwd(grad_y.contiguous(), *ctx.saved_tensors, ctx.recipe, ctx.x_dtype, ctx.w_dtype)
    return dx, dw, None, None


torch.library.register_autograd("fp4::linear_fwd", _linear_backward, setup_context=_linear_setup)


class _LinearFn(torch.autograd.Function):
    """The eager twin of the custom ops above (same functions, less dispatch overhead)."""

    @staticmethod
    def forward(ctx, x, w, recipe, out_dtype):
        out = _linear_fwd_impl(x, w, recipe, out_dtype)
        _linear_setup(ctx, (x, w, recipe, out_dtype), out)
        return out[0]

    @staticmethod
    def backward(ctx, grad_y):
        dx, dw = _linear_bwd_impl(grad_y.contiguous(), *ctx.saved_tensors, ctx.recipe, ctx.x_dtype, ctx.w_dtype)
        return dx, dw, None, None


class FP4Linear(torch.nn.Linear):
    """nn.Linear whose forward, input-gradient and weight-gradient GEMMs run on FP4 operands
    under `recipe` (RECIPES). Same parameters and state_dict as nn.Linear; fullstack adds L's two
    BF16 factors as buffers (lora_rank: see "LoRA-SVD projections" below)."""

    def __init__(self, in_features, out_features, bias=False, recipe="quartet", device=None, dtype=None,
                 lora_rank=0):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        mult = _dim_multiple(recipe)
        if in_features % mult or out_features % mult:
            raise ValueError(f"recipe {recipe!r} needs in and out features divisible by {mult}, got {in_features}->{out_features}")
        self.recipe = recipe
        _init_lora(self, lora_rank, device)  # fullstack: the BF16 rank-r part (SPEC 8.4)

    def forward(self, x):
        if self.recipe == "bf16":
            return torch.nn.functional.linear(x, self.weight, self.bias)
        x2 = x.reshape(-1, self.in_features)  # (M, K), M = tokens
        if x2.shape[0] % _dim_multiple(self.recipe):
            raise ValueError(f"recipe {self.recipe!r} needs the token count (batch * seq = {x2.shape[0]}) divisible by {_dim_multiple(self.recipe)}")
        out_dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        x2 = x2.to(out_dtype) if x2.dtype != out_dtype else x2
        w = _lora_residual(self) if self.lora_rank else self.weight  # fullstack: R = W - L
        if torch.compiler.is_compiling():
            y = _linear_fwd(x2, w, self.recipe, out_dtype)[0]
        else:
            y = _LinearFn.apply(x2, w, self.recipe, out_dtype)
        if self.lora_rank:
            y = y + _lora_lowrank(self, x2)
        y = y.view(*x.shape[:-1], self.out_features)
        return y + self.bias.to(y.dtype) if self.bias is not None else y

    def extra_repr(self):
        return super().extra_repr() + f", recipe={self.recipe}" + (f", lora_rank={self.lora_rank}" if self.lora_rank else "")


def to_fp4(model, recipe="quartet", skip=None, lora_rank=0):
    """Swap every nn.Linear in `model` for an FP4Linear (same Parameters), in place. skip is a
    callable skip(name, module) -> bool, or an iterable of name substrings to leave alone.
    lora_rank: FP4Linear's (fullstack only); L starts at 0: call refit_lora(model) to fit it."""
    _recipe(recipe)
    if skip is not None and not callable(skip):
        names = tuple(skip)
        skip = lambda name, _: any(s in name for s in names)  # noqa: E731
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is not torch.nn.Linear or (skip and skip(full, child)):
                continue
            new = FP4Linear(child.in_features, child.out_features, child.bias is not None, recipe,
                            device="meta", lora_rank=lora_rank)
            new.weight, new.bias = child.weight, child.bias
            _lora_place(new)
            setattr(mod, child_name, new)
    return model


# ---------------------------------------------------------------------------------------------
# LoRA-SVD projections and the fullstack recipe (SPEC 8.4)
#
# W, the FP32 master (the Parameter), is split as W = L + R. L = U_r S_r V_r^T, the top-r part of
# W from a randomized SVD, lives in two BF16 buffers, lora_us = U_r S_r (N, r) and lora_v = V_r
# (K, r), fixed between refits (refit_lora) and saved in the state_dict. R = W - L is recomputed
# in FP32 every step and goes through the recipe's FP4 linear (four_over_six NVFP4). So
#   forward  y  = (x V_r)(U_r S_r)^T   [BF16]  +  Q(x) Q(R)^T             [NVFP4]
#   dgrad    dX = (E U_r S_r) V_r^T    [BF16]  +  Q(E) Q(R)               [NVFP4]
#   wgrad    dW = dR = Q(E)^T Q(X)                                        [NVFP4]
# The BF16 part is plain torch ops (autograd differentiates it; the buffers get no gradient), and
# dR/dW = I, so the recipe's FP4 weight gradient is W's gradient.

def _init_lora(layer, lora_rank, device):
    """FP4Linear's LoRA state: layer.lora_rank (0: none) and, for r > 0, the two BF16 buffers,
    zero (L = 0) until refit_lora fits them. lora_rank 0 asks for lora_rank_for(in, out), -1 for
    no low-rank part (the fullstack ablation)."""
    n, k = layer.out_features, layer.in_features
    if not isinstance(lora_rank, int) or isinstance(lora_rank, bool):
        raise TypeError(f"lora_rank must be an int, got {type(lora_rank).__name__}")
    if layer.recipe != "fullstack":
        if lora_rank:
            raise ValueError(f"lora_rank is a parameter of recipe 'fullstack', not {layer.recipe!r}")
        layer.lora_rank = 0
        return
    r = lora_rank_for(k, n) if lora_rank == 0 else max(lora_rank, 0)
    if lora_rank < -1 or r > min(n, k):
        raise ValueError(f"lora_rank must be -1 (none), 0 (default) or 1..min(in, out) = {min(n, k)} "
                         f"for a {k}->{n} layer, got {lora_rank}")
    layer.lora_rank = r
    if r:
        layer.register_buffer("lora_us", torch.zeros(n, r, device=device, dtype=torch.bfloat16))  # U_r S_r
        layer.register_buffer("lora_v", torch.zeros(k, r, device=device, dtype=torch.bfloat16))  # V_r


def _lora_place(layer):
    """Give a layer built on the meta device (to_fp4) real zero buffers on its weight's device."""
    dev = layer.weight.device
    for name in ("lora_us", "lora_v"):
        buf = getattr(layer, name, None)
        if buf is not None and buf.device != dev:
            setattr(layer, name, torch.zeros(buf.shape, device=dev, dtype=torch.bfloat16))


def _lora_residual(layer):
    """R = W - U_r S_r V_r^T in FP32 (N, K); its gradient is W's. Autocast off: L's product
    must not be rounded to BF16 before the subtraction. (TF32, if allowed, changes only the
    summation order: BF16 factors are exact in TF32, their products exact in FP32.)"""
    with torch.autocast(layer.weight.device.type, enabled=False):
        low = layer.lora_us.float() @ layer.lora_v.float().t()  # (N, r) @ (r, K)
        return layer.weight.float() - low


def _lora_lowrank(layer, x2):
    """(x V_r)(U_r S_r)^T in BF16 for x2 (M, K): (M, K) @ (K, r) -> (M, r) @ (r, N) -> (M, N)."""
    xr = x2.to(torch.bfloat16) @ layer.lora_v.to(torch.bfloat16)
    return xr @ layer.lora_us.to(torch.bfloat16).t()


@torch.no_grad()
def refit_lora(model, seed=0):
    """Refit L = U_r S_r V_r^T of every fullstack FP4Linear in `model` (a module, or an
    FP4Linear) from its current weight, by randomized_svd (seed + the layer's index). W is not
    changed: R = W - L absorbs the difference from the next forward on. Returns the number of
    layers refitted."""
    layers = [m for m in model.modules() if isinstance(m, FP4Linear) and m.lora_rank]
    for i, layer in enumerate(layers):
        if not torch.isfinite(layer.weight).all():
            raise ValueError(f"refit_lora: layer {i} ({layer.extra_repr()}) has a non-finite weight")
        u, s, v = randomized_svd(layer.weight, layer.lora_rank, seed=seed + i)
        layer.lora_us.copy_(u * s)  # (N, r) * (r,): the singular values go with U
        layer.lora_v.copy_(v)
    return len(layers)
