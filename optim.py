"""
Optimizers for FP4 pretraining (SPEC.md 8.1-8.2): AdamW with FP4 (NVFP4) states, and the
Muon family (Muon, ROOT) whose Newton-Schulz iteration can run its GEMMs in NVFP4.

Read top to bottom: the FP4 state quantizer (shared by every optimizer here), AdamW, Newton-Schulz
and Muon/ROOT, then build() and state_bytes().
"""
import math

import torch

import fp4

# ---------------------------------------------------------------------------------------------
# FP4 optimizer states (SPEC 8.1): the quantizer every optimizer here stores its states with
#
# Contract (used by AdamW and by ROOT's optional NVFP4 momentum):
#   quantize_state(x, kind, seed) -> an object holding the packed state (kind 'signed' for a first
#       moment / momentum, 'sqrt' for a second moment stored as sqrt(v)); it is what state_dict()
#       holds; dequantize_state(s) -> FP32 tensor of x's shape; state_nbytes(s) -> bytes it holds.
# PLACEHOLDER until the AdamW-FP4 work lands: an FP32 copy (no quantization).


def quantize_state(x, kind="signed", seed=0):
    return x.detach().float().clone()


def dequantize_state(s):
    return s


def state_nbytes(s):
    return s.numel() * s.element_size()


# ---------------------------------------------------------------------------------------------
# AdamW (SPEC 8.1)


# ---------------------------------------------------------------------------------------------
# Newton-Schulz, Muon and ROOT (SPEC 8.2)
#
# newton_schulz(G) approximates the polar factor U V^T of G = U S V^T with the quintic iteration
# (SPEC 8.2): X = G / ||G||_F (transposed so rows <= cols), then per step A = X X^T,
# B = b A + c A A, X = a X + B X. The map on each singular value, f(s) = a s + b s^3 + c s^5,
# sends (0, 1] into a band around 1 (Muon's coefficients: about [0.68, 1.2]) rather than to 1.
#
# precision='nvfp4' runs the GEMMs on NVFP4 operands (fp4.quantize along the contraction dim,
# fp4.mm). Casting the three GEMMs of every step diverges (SPEC 8.2); the measurements that chose
# the design below are in README "Muon and ROOT with FP4 Newton-Schulz" (bench.py --sections ns).
# What made it accurate, one step at a time:
# - residual form: quantize D = A - mu I (mu = tr(A) / m) instead of A, and B' = B - beta I
#   instead of B, with X_new = (a + beta) X + B' X. A and B are dominated by their diagonal once X
#   is near-orthogonal; a 16-block holding a diagonal entry rounds its off-diagonal ones to zero.
#   The shifts are exact algebra: B = (b mu + c mu^2) I + (b + 2 c mu) D + c D^2.
# - a guard: the quintic sends s > 1.26 off to infinity, and FP4 Gram noise pushes the top
#   singular values past it; ten power iterations on A (O(m^2) each) estimate lambda_max and X is
#   scaled down when s_max > 1.2, the top of the exact band.
# - a compensated tail: FP4 errors made in the last two steps are not undone by later steps
#   (the band is not contracting as a whole: f'(1.2) = 3.9), so there every operand is two NVFP4
#   terms, x ~ Q(x) + Q(x - Q(x)) (relative error ~1% instead of ~10%): the Gram takes 2 FP4
#   GEMMs (Q1 Q1^T + C + C^T, C = Q1 Q2^T), B' X takes 3 (the Q2 Q2 term is dropped).

MUON_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
# ROOT (arXiv 2511.20626): one (a, b, c) for all steps, tuned per matrix shape, keyed here by
# (min dim, max dim), so a matrix and its transpose share them (SPEC 8.2)
ROOT_COEFFICIENTS = {
    (2048, 2048): (3.4916, -4.8224, 2.1095),
    (2048, 3072): (3.4509, -4.5790, 1.9325),
    (2048, 8192): (2.9794, -3.6674, 1.6207),
    (2048, 16384): (3.1943, -3.8221, 1.5322),
}
NS_PRECISIONS = ("fp32", "bf16", "nvfp4")
# How each step of an nvfp4 iteration runs, per design (measured in the README):
#   'n' naive: Muon's form, A, A A and B X each one NVFP4 GEMM, no guard
#   'f' residual form + guard, one NVFP4 GEMM per product
#   'c' residual form + guard, compensated (two-term) operands, all GEMMs NVFP4
#   'g' BF16 (the plain bf16 step) + guard
NS_DESIGNS = {
    "naive": ("n", "n"),            # (mode of the first steps, mode of the last TAIL steps)
    "residual": ("f", "f"),
    "bf16_tail": ("f", "g"),
    "compensated_tail": ("f", "c"),
}
NS_TAIL = 2  # steps at the end that run in the tail mode
GUARD_S = 1.2  # the guard's bound on the top singular value


def ns_coefficients(shape, coefficients="root"):
    """(a, b, c) for a matrix of `shape`: ROOT's table entry for its (min, max) dims, else Muon's;
    coefficients='muon' is always Muon's; an explicit (a, b, c) is returned as is."""
    if isinstance(coefficients, (tuple, list)) and len(coefficients) == 3:
        return tuple(float(v) for v in coefficients)
    if coefficients == "muon":
        return MUON_COEFFICIENTS
    if coefficients == "root":
        return ROOT_COEFFICIENTS.get((min(shape), max(shape)), MUON_COEFFICIENTS)
    raise ValueError(f"coefficients must be 'root', 'muon' or a tuple (a, b, c), got {coefficients!r}")


def newton_schulz(G, steps=5, coefficients=MUON_COEFFICIENTS, precision="fp32",
                  design="compensated_tail", stats=None):
    """Approximate polar factor of the 2-D G (FP32 result, G's shape). precision: 'fp32',
    'bf16' (Muon's reference: X and every product in BF16) or 'nvfp4' (the GEMMs on NVFP4
    operands, laid out by `design`, a key of NS_DESIGNS). stats, if a dict, collects the GEMM
    FLOPs per precision: stats['nvfp4'], stats['bf16'], stats['fp32']."""
    a, b, c = _check_ns(G, steps, coefficients, precision, design)
    X = G.detach().float()
    transposed = X.shape[0] > X.shape[1]
    X = X.t() if transposed else X  # (m, n), m <= n: the Gram is the smaller m x m
    X = X / (X.norm() + 1e-7)  # every singular value <= 1
    for mode in _ns_plan(precision, design, steps):
        X = _NS_STEPS[mode](X, (a, b, c), stats)
    return X.t() if transposed else X


def _check_ns(G, steps, coefficients, precision, design):
    if not isinstance(G, torch.Tensor) or G.ndim != 2:
        raise ValueError(f"newton_schulz takes a 2-D tensor, got {getattr(G, 'shape', type(G).__name__)}")
    if not G.is_floating_point():
        raise TypeError(f"newton_schulz takes a floating-point tensor, got {G.dtype}")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if precision not in NS_PRECISIONS:
        raise ValueError(f"precision must be one of {NS_PRECISIONS}, got {precision!r}")
    if design not in NS_DESIGNS:
        raise ValueError(f"design must be one of {list(NS_DESIGNS)}, got {design!r}")
    if precision == "nvfp4" and (G.shape[0] % 16 or G.shape[1] % 16):
        raise ValueError(f"nvfp4 Newton-Schulz needs both dims divisible by 16 (the NVFP4 block), got {tuple(G.shape)}")
    if not (isinstance(coefficients, (tuple, list)) and len(coefficients) == 3):
        raise ValueError(f"coefficients must be a tuple (a, b, c), got {coefficients!r}")
    return tuple(float(v) for v in coefficients)


def _ns_plan(precision, design, steps):
    """The mode of each step: 'e' fp32, 'b' bf16, or the design's FP4 modes."""
    if precision != "nvfp4":
        return ("e" if precision == "fp32" else "b") * steps
    head, tail = NS_DESIGNS[design]
    k = min(NS_TAIL, steps)
    return head * (steps - k) + tail * k


def _count(stats, precision, flops):
    if stats is not None:
        stats[precision] = stats.get(precision, 0) + flops


def _step_fp32(X, abc, stats):
    a, b, c = abc
    m, n = X.shape
    A = X @ X.t()  # (m, m)
    B = b * A + c * (A @ A)
    _count(stats, "fp32", 4 * m * m * n + 2 * m**3)
    return a * X + B @ X


def _step_bf16(X, abc, stats, guard=False):
    """Muon's reference step: X, A, B and every product rounded to BF16 (FP32 accumulation).
    guard: the nvfp4 designs' BF16 tail, which may inherit FP4 noise past the band (_guard)."""
    a, b, c = abc
    m, n = X.shape
    Xb = X.bfloat16()
    A = Xb @ Xb.t()
    if guard:
        X, A = _guard(X, A.float())
        Xb, A = X.bfloat16(), A.bfloat16()
    B = b * A + c * (A @ A)
    _count(stats, "bf16", 4 * m * m * n + 2 * m**3)
    return (a * Xb + B @ Xb).float()


def _nv(x, axis=-1):
    return fp4.quantize(x, "nvfp4", axis=axis)


def _nvmm(qa, qb, stats):
    """dequant(qa) @ dequant(qb)^T in FP32, counted as an NVFP4 GEMM."""
    (m, k), n = qa.lead_shape, qb.lead_shape[0]
    _count(stats, "nvfp4", 2 * m * n * k)
    return fp4.mm(qa, qb, out_dtype=torch.float32)


def _two_terms(x, axis=-1):
    """x ~ Q1 + Q2 as two NVFP4 QTensors: Q2 quantizes what Q1 missed (SPEC 2 amax scaling
    makes Q2's scale follow the residual's own amax)."""
    q1 = _nv(x, axis)
    return q1, _nv(x - fp4.dequantize(q1), axis)


def _step_naive(X, abc, stats):
    """The cast: Muon's step with every GEMM on NVFP4 operands (diverges; the baseline)."""
    a, b, c = abc
    qx = _nv(X)  # (m, n) along n: the Gram's contraction dim
    A = _nvmm(qx, qx, stats)  # (m, m)
    qa = _nv(A)  # A is symmetric: A A = A A^T, contraction along A's rows
    B = b * A + c * _nvmm(qa, qa, stats)
    return a * X + _nvmm(_nv(B), _nv(X, axis=0), stats)  # B X: contraction over m


def _gram(X, compensated, stats):
    """A = X X^T (m, m) on NVFP4 operands quantized along n."""
    if not compensated:
        qx = _nv(X)
        return _nvmm(qx, qx, stats)
    q1, q2 = _two_terms(X)
    C = _nvmm(q1, q2, stats)  # Q1 Q2^T; Q2 Q1^T is its transpose
    return _nvmm(q1, q1, stats) + C + C.t()


def _guard(X, A, iters=10):
    """Scale X (and A = X X^T) down if the top singular value, estimated by power iteration on A
    from a fixed start, exceeds GUARD_S. Exact iterates never exceed it, so this only catches
    FP4 noise before the quintic blows it up. Renormalised every 4 products (lambda_max lies
    between 1/m and a few, so 4 plain products stay well inside FP32's range); tensor ops only:
    no host sync on a GPU."""
    v = torch.ones(A.shape[0], 1, device=A.device)
    for i in range(iters):
        v = A @ v
        if i % 4 == 3:
            v = v / (v.norm() + 1e-30)
    lam = (A @ v).norm() / (v.norm() + 1e-30)
    r = torch.clamp(GUARD_S**2 / lam, max=1.0)
    return X * r.sqrt(), A * r


def _step_residual(X, abc, stats, compensated=False):
    """One guarded step in residual form (the section's header): 3 NVFP4 GEMMs, or 6 compensated."""
    a, b, c = abc
    m = X.shape[0]
    eye = torch.eye(m, device=X.device)
    X, A = _guard(X, _gram(X, compensated, stats))
    mu = torch.trace(A) / m
    D = A - mu * eye  # (m, m), symmetric, trace 0
    qd = _nv(D)
    D2 = _nvmm(qd, qd, stats)  # D D^T = D^2
    delta = torch.trace(D2) / m
    beta = b * mu + c * mu * mu + c * delta  # B = beta I + B'
    Bp = (b + 2 * c * mu) * D + c * (D2 - delta * eye)
    if not compensated:
        return (a + beta) * X + _nvmm(_nv(Bp), _nv(X, axis=0), stats)
    b1, b2 = _two_terms(Bp)
    x1, x2 = _two_terms(X, axis=0)  # X^T along m: (n, m)
    BX = _nvmm(b1, x1, stats) + _nvmm(b1, x2, stats) + _nvmm(b2, x1, stats)
    return (a + beta) * X + BX


_NS_STEPS = {
    "e": _step_fp32, "b": _step_bf16, "n": _step_naive,
    "g": lambda X, abc, stats: _step_bf16(X, abc, stats, guard=True),
    "f": _step_residual, "c": lambda X, abc, stats: _step_residual(X, abc, stats, compensated=True),
}


def soft_threshold(M, quantile=0.9):
    """ROOT's outlier removal (SPEC 8.2): B = clamp(M, -eps, eps), eps the `quantile` of |M| over
    the whole matrix (the k-th smallest |M|, k = ceil(quantile * numel)); quantile=None or 1 keeps
    M. Only B is orthogonalised: the clipped excess M - B is dropped from this step."""
    if quantile is None or quantile >= 1:
        return M
    flat = M.detach().abs().flatten()
    k = max(1, math.ceil(quantile * flat.numel()))
    eps = flat.kthvalue(k).values  # torch.quantile refuses tensors over 2^24 elements
    return M.clamp(-eps, eps)


UPDATE_SCALES = ("rms", "shape")


def update_scale(shape, rule="rms"):
    """The factor on the orthogonalised update (SPEC 8.2): 'rms' = 0.2 sqrt(max dim) gives it
    AdamW's update RMS (~0.2), so AdamW's lr and weight decay carry over (Moonlight's rule, the
    default here); 'shape' = max(1, rows / cols)^0.5 (Keller Jordan's Muon; its lr is ~10-50x
    AdamW's)."""
    rows, cols = shape
    if rule == "rms":
        return 0.2 * math.sqrt(max(rows, cols))
    if rule == "shape":
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"update scale rule must be one of {UPDATE_SCALES}, got {rule!r}")


class ROOT(torch.optim.Optimizer):
    """ROOT / Muon for 2-D weights (SPEC 8.2). Per matrix and step:
        m = momentum * m + (1 - momentum) * g            (EMA momentum)
        u = momentum * m + (1 - momentum) * g  if nesterov, else m
        u = soft_threshold(u, soft_threshold)           (ROOT; None for Muon)
        O = newton_schulz(u, ns_steps, ns_coefficients(shape, coefficients), ns)
        W = W * (1 - lr * weight_decay) - lr * update_scale(shape, scale) * O
    coefficients='root' (ROOT's shape table, Muon's elsewhere) or 'muon'; ns='fp32'|'bf16'|'nvfp4';
    state='nvfp4' stores m through quantize_state(m, 'signed') (SPEC 8.1). Muon is
    ROOT(coefficients='muon', soft_threshold=None); 1-D, 3-D and embedding weights belong on AdamW
    (build() sorts them)."""

    def __init__(self, params, lr=1.5e-3, momentum=0.95, weight_decay=0.1, coefficients="root",
                 soft_threshold=0.9, ns="bf16", state="fp32", nesterov=True, ns_steps=5,
                 ns_design="compensated_tail", scale="rms"):
        _check_root_options(lr, momentum, weight_decay, coefficients, soft_threshold, ns, state,
                            ns_steps, ns_design, scale)
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, coefficients=coefficients,
                        soft_threshold=soft_threshold, ns=ns, state=state, nesterov=nesterov,
                        ns_steps=ns_steps, ns_design=ns_design, scale=scale)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                _check_root_param(p, group["ns"])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0  # the param's position in the optimizer: part of its SR seed
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group, index)
                index += 1
        return loss

    def _update(self, p, group, index):
        g = p.grad.float()
        st = self.state[p]
        if not st:
            st["step"] = 0
            zeros = torch.zeros_like(g)
            st["momentum_buffer"] = zeros if group["state"] == "fp32" else quantize_state(zeros, "signed", 0)
        st["step"] += 1
        beta = group["momentum"]
        if group["state"] == "fp32":
            buf = st["momentum_buffer"].lerp_(g, 1 - beta)
        else:  # dequantize, update in FP32, re-quantize (SPEC 8.1); this step uses the FP32 value
            buf = dequantize_state(st["momentum_buffer"]).float().lerp_(g, 1 - beta)
            st["momentum_buffer"] = quantize_state(buf, "signed", seed=st["step"] * 65536 + index)
        u = g.lerp(buf, beta) if group["nesterov"] else buf
        u = soft_threshold(u, group["soft_threshold"])
        abc = ns_coefficients(p.shape, group["coefficients"])
        O = newton_schulz(u, group["ns_steps"], abc, group["ns"], group["ns_design"])
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(O.to(p.dtype), alpha=-group["lr"] * update_scale(p.shape, group["scale"]))


ROOT_STATES = ("fp32", "nvfp4")


def _check_root_options(lr, momentum, weight_decay, coefficients, soft_threshold, ns, state,
                        ns_steps, ns_design, scale):
    if not lr >= 0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    ns_coefficients((1, 1), coefficients)  # raises on a bad value
    if soft_threshold is not None and not 0 < soft_threshold <= 1:
        raise ValueError(f"soft_threshold (a quantile of |M|) must be in (0, 1] or None, got {soft_threshold}")
    if ns not in NS_PRECISIONS:
        raise ValueError(f"ns must be one of {NS_PRECISIONS}, got {ns!r}")
    if state not in ROOT_STATES:
        raise ValueError(f"state must be one of {ROOT_STATES}, got {state!r}")
    if not isinstance(ns_steps, int) or ns_steps < 1:
        raise ValueError(f"ns_steps must be a positive int, got {ns_steps!r}")
    if ns_design not in NS_DESIGNS:
        raise ValueError(f"ns_design must be one of {list(NS_DESIGNS)}, got {ns_design!r}")
    update_scale((1, 1), scale)  # raises on a bad rule


def _check_root_param(p, ns):
    if p.ndim != 2:
        raise ValueError(f"ROOT/Muon orthogonalise 2-D weights only; got a {p.ndim}-D parameter of shape "
                         f"{tuple(p.shape)}: give 1-D, 3-D and embedding parameters to AdamW (optim.build does)")
    if ns == "nvfp4" and (p.shape[0] % 16 or p.shape[1] % 16):
        raise ValueError(f"ns='nvfp4' needs both dims divisible by 16, got a parameter of shape {tuple(p.shape)}")


# ---------------------------------------------------------------------------------------------
# build(model, name) and state_bytes(optimizer)

OPTIMIZERS = ("adamw", "adamw_fp4", "muon", "root", "root_fp4", "torch_muon")


def build(model, name, lr=1.5e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, **root_hyper):
    """The optimizer `name` (OPTIMIZERS) for a model, one object with torch's interface.
    'adamw': AdamW on everything (matrices decayed, 1-D parameters not), as model.configure_optimizers.
    'muon' / 'root' / 'root_fp4' / 'torch_muon': 2-D hidden weights on Muon / ROOT / ROOT with
    NVFP4 Newton-Schulz and NVFP4 momentum / torch.optim.Muon; embeddings, lm_head and 1-D
    parameters on AdamW. Both parts share lr and weight_decay: the Muon family's update is scaled
    to AdamW's RMS (update_scale 'rms'). root_hyper goes to ROOT (momentum, ns_steps, ...)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    hidden, rest = _split_params(model)
    if name in ("adamw", "adamw_fp4"):
        return _adamw(_decay_groups(hidden + rest, weight_decay), lr, betas, eps, fp4_state=name == "adamw_fp4")
    adamw = _adamw(_decay_groups(rest, weight_decay), lr, betas, eps, fp4_state=False)  # MERGE HOOK: root_fp4 -> True
    if name == "torch_muon":
        muon = torch.optim.Muon(hidden, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
    else:
        preset = dict(muon=dict(coefficients="muon", soft_threshold=None),
                      root=dict(coefficients="root", soft_threshold=0.9),
                      root_fp4=dict(coefficients="root", soft_threshold=0.9, ns="nvfp4", state="nvfp4"))[name]
        muon = ROOT(hidden, lr=lr, weight_decay=weight_decay, **{**preset, **root_hyper})
    return Optimizers(muon, adamw)


def _split_params(model):
    """(2-D hidden weights, everything else): embeddings (nn.Embedding weights) and the output
    head (a module named lm_head) stay on AdamW with the 1-D parameters. Model order."""
    special = set()
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Embedding) or name.split(".")[-1] == "lm_head":
            special.update(id(p) for p in mod.parameters())
    params = [p for p in model.parameters() if p.requires_grad]
    hidden = [p for p in params if p.ndim == 2 and id(p) not in special]
    return hidden, [p for p in params if p.ndim != 2 or id(p) in special]


def _decay_groups(params, weight_decay):
    """Weight decay on matrices, none on 1-D parameters (norm gains, biases)."""
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def _adamw(groups, lr, betas, eps, fp4_state):
    """build()'s AdamW. MERGE HOOK: with the AdamW section merged, fp4_state=True builds
    AdamW(groups, lr, betas, eps, state='nvfp4') and root_fp4 passes fp4_state=True; until then
    there is only torch's FP32 AdamW, and adamw_fp4 refuses rather than silently run FP32 states."""
    if fp4_state:
        raise NotImplementedError("adamw_fp4 needs optim.AdamW(state='nvfp4') (the FP4-state section); "
                                  "not merged on this branch")
    fused = all(p.device.type in ("cuda", "cpu") for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused)


class Optimizers:
    """Several optimizers stepped as one (build()'s result): param_groups is every part's groups
    (the same dicts, so setting group['lr'] reaches them), state_dict() holds each part's."""

    def __init__(self, *parts):
        self.parts = [o for o in parts if o.param_groups and any(g["params"] for g in o.param_groups)]

    @property
    def param_groups(self):
        return [g for o in self.parts for g in o.param_groups]

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for o in self.parts:
            o.step()
        return loss

    def zero_grad(self, set_to_none=True):
        for o in self.parts:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {"parts": [o.state_dict() for o in self.parts], "kinds": [type(o).__name__ for o in self.parts]}

    def load_state_dict(self, sd):
        kinds = [type(o).__name__ for o in self.parts]
        if sd.get("kinds") != kinds:
            raise ValueError(f"optimizer state is for {sd.get('kinds')}, this optimizer is {kinds}")
        for o, s in zip(self.parts, sd["parts"]):
            o.load_state_dict(s)
