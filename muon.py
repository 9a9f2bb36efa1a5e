"""
The Muon family for FP4 pretraining (SPEC.md 8.2): Muon and ROOT, which orthogonalise 2-D hidden
weights' momentum by Newton-Schulz (newton_schulz.py; its GEMMs can run in NVFP4), and build(),
which gives each of a model's parameters its optimizer: 2-D hidden weights to Muon/ROOT, the rest
to AdamW (optim.py, as are the FP4 states ROOT's momentum can be stored in).

Read top to bottom: ROOT's soft threshold and update scale, ROOT (Muon is ROOT with Muon's
coefficients and no threshold), its momentum's formats, then build() and Optimizers.
"""
import math

import torch

import distributed
from newton_schulz import GraphedNS, NS_DESIGN, NS_DESIGNS, NS_GRAPH, NS_PRECISIONS, newton_schulz, ns_coefficients
from optim import AdamW, PackedStates, dequantize_state, is_packed, quantize_state, _placed, _run_closure

# ---------------------------------------------------------------------------------------------
# Muon and ROOT (SPEC 8.2): the update orthogonalised by Newton-Schulz (newton_schulz.py)

def soft_threshold(M, quantile=0.9):
    """ROOT's outlier removal (SPEC 8.2): B = clamp(M, -eps, eps), eps the `quantile` of |M| over
    the whole matrix (the k-th smallest |M|, k = ceil(quantile * numel)); quantile=None or 1 keeps
    M. Only B is orthogonalised: the clipped excess M - B is dropped from this step."""
    if quantile is None or quantile >= 1:
        return M
    flat = M.detach().abs().flatten().float()
    k = max(1, math.ceil(quantile * flat.numel()))
    eps = kth_smallest(flat, k)  # torch.quantile refuses tensors over 2^24 elements
    return M.clamp(-eps.to(M.dtype), eps.to(M.dtype))


def kth_smallest(x, k):
    """The k-th smallest (1-based) element of the 1-D FP32 x, as a 0-d tensor: torch.kthvalue's
    value (NaN ordered above every number). By torch.topk of the smaller side: the largest of the
    k smallest, or the smallest of the n - k + 1 largest (ROOT's k = 0.9 n: a tenth), sorted, so
    the last is the one (a min over them would let a NaN through). No host sync. On the H200 it
    takes 0.30 ms on a 30M MLP matrix and 0.47 ms on a 1B one, against 1.25 and 9.8 ms for the
    two 16-bit histograms it replaces and 4.9 and 75 ms for kthvalue, which selects within one
    CTA per slice (measured on the H200; unsorted, with a min, 0.17 and 0.33 ms)."""
    if x.ndim != 1 or x.dtype != torch.float32 or not 1 <= k <= x.numel():
        raise ValueError(f"kth_smallest takes a 1-D float32 tensor and 1 <= k <= numel, got "
                         f"{x.dtype} {tuple(x.shape)} and k={k}")
    top = x.numel() - k + 1  # the k-th smallest is the top-th largest
    if k <= top:
        return torch.topk(x, k, largest=False, sorted=True).values[-1]
    return torch.topk(x, top, largest=True, sorted=True).values[-1]


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


class ROOT(PackedStates, torch.optim.Optimizer):
    """ROOT / Muon for 2-D weights (SPEC 8.2). Per matrix and step:
        m = momentum * m + (1 - momentum) * g            (EMA momentum)
        u = momentum * m + (1 - momentum) * g  if nesterov, else m
        u = soft_threshold(u, soft_threshold)           (ROOT; None for Muon)
        O = newton_schulz(u, ns_steps, ns_coefficients(shape, coefficients), ns)
        W = W * (1 - lr * weight_decay) - lr * update_scale(shape, scale) * O
    coefficients='root' (ROOT's shape table, Muon's elsewhere) or 'muon'; ns='fp32'|'bf16'|'nvfp4';
    state='bf16' stores m in BF16 (2 B/param); 'nvfp4' through quantize_state(m, 'signed') (SPEC
    8.1, one NVFP4 term: 0.56 B/param); 'nvfp4x2' as two NVFP4 terms, m ~ Q(m) + Q(m - Q(m)), both
    rounded to nearest (1.125 B/param); see ROOT_STATES for what they cost. Muon is
    ROOT(coefficients='muon', soft_threshold=None); 1-D, 3-D and embedding weights belong on AdamW
    (build() sorts them). ns_graph: on a GPU, replay ns='nvfp4' Newton-Schulz as one CUDA graph per
    matrix shape (GraphedNS: the same kernels, without their launch cost); None: FP4_NS_GRAPH (on unless it is 0)."""

    def __init__(self, params, lr=1.5e-3, momentum=0.95, weight_decay=0.1, coefficients="root",
                 soft_threshold=0.9, ns="bf16", state="fp32", nesterov=True, ns_steps=5,
                 ns_design=NS_DESIGN, scale="rms", ns_graph=None):
        _check_root_options(lr, momentum, weight_decay, coefficients, soft_threshold, ns, state,
                            ns_steps, ns_design, scale)
        ns_graph = NS_GRAPH if ns_graph is None else ns_graph
        if not isinstance(ns_graph, bool):
            raise TypeError(f"ns_graph must be True, False or None (FP4_NS_GRAPH's default), got {ns_graph!r}")
        self._ns = GraphedNS() if ns_graph else newton_schulz  # graphs only where they apply
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, coefficients=coefficients,
                        soft_threshold=soft_threshold, ns=ns, state=state, nesterov=nesterov,
                        ns_steps=ns_steps, ns_design=ns_design, scale=scale)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                _check_root_param(p, group["ns"])

    @torch.no_grad()
    def step(self, closure=None):
        loss = _run_closure(closure)
        # (param, group, index): index, the param's position in the optimizer, is part of its SR seed
        todo = [(p, g, i) for i, (p, g) in enumerate((p, g) for g in self.param_groups for p in g["params"])
                if p.grad is not None]
        for p, group, index in todo:
            if not distributed.is_sharded(p):
                O = self._orthogonalise(self._momentum(p, group, index, None), p.shape, group)
                self._apply(p, group, O)  # O is used before the next call (GraphedNS)
        # FSDP2: the momentum on each rank's rows; Newton-Schulz on whole matrices, one per rank at a time
        sharded = [t for t in todo if distributed.is_sharded(t[0])]
        world = distributed.Rows(sharded[0][0]).world if sharded else 1
        for start in range(0, len(sharded), world):
            chunk = sharded[start:start + world]
            rows = [distributed.Rows(p) for p, _, _ in chunk]
            us = [self._momentum(p, group, index, r) for (p, group, index), r in zip(chunk, rows)]
            Os = distributed.on_whole_matrices(
                lambda i, u: self._orthogonalise(u, chunk[i][0].shape, chunk[i][1]), us, rows)
            for (p, group, _), O in zip(chunk, Os):
                self._apply(p, group, O)
        return loss

    def _momentum(self, p, group, index, shard):
        """The momentum step on p (shard: this rank's rows of it); returns the update to
        orthogonalise, u (FP32)."""
        g = distributed.local(p.grad).float()
        st = self.state[p]
        if not st:
            st["step"] = 0
            st.update(_momentum_state(torch.zeros_like(g), group["state"], 0, shard))
        st["step"] += 1
        beta = group["momentum"]
        if group["state"] == "fp32":
            buf = distributed.local(st["momentum_buffer"]).lerp_(g, 1 - beta)
        else:  # dequantize, update in FP32, re-quantize (SPEC 8.1); this step uses the FP32 value
            buf = _momentum_value(st).lerp_(g, 1 - beta)
            st.update(_momentum_state(buf, group["state"], st["step"] * 65536 + index, shard))
        return g.lerp(buf, beta) if group["nesterov"] else buf

    def _orthogonalise(self, u, shape, group):
        """Newton-Schulz on the whole matrix u (SPEC 8.2), after ROOT's soft threshold."""
        u = soft_threshold(u, group["soft_threshold"])
        abc = ns_coefficients(shape, group["coefficients"])
        return self._ns(u, group["ns_steps"], abc, group["ns"], group["ns_design"])

    @staticmethod
    def _apply(p, group, O):
        """W = W (1 - lr wd) - lr scale O, on p's rows (O: those rows of the orthogonalised update)."""
        w = distributed.local(p)
        w.mul_(1 - group["lr"] * group["weight_decay"])
        w.add_(O.to(w.dtype), alpha=-group["lr"] * update_scale(p.shape, group["scale"]))


# ROOT's momentum state. One NVFP4 term (SPEC 8.1's signed m, SR) is too coarse for an
# orthogonalised update: each step's re-quantization adds an error of ~10% of |m| (NVFP4's
# relative RMS error), the EMA keeps the last ~1 / (1 - beta^2) = 10 of them, so m is 20-35% off,
# and Newton-Schulz maps every direction of that noise to a singular value ~1, as it does the
# signal's. measure.py --sections root_states replays the recursion (docs/fullstack.md, "The momentum's
# format"): the update's cosine to the FP32-momentum update is 0.54-0.86 with one term, 0.981-0.999
# with two terms rounded to nearest (the second holds the first's error: ~2.5% of |m| is left),
# 0.999-1.000 in BF16, against 0.995-0.999 for NVFP4 Newton-Schulz itself. At 30M one term cost
# root_fp4 +2.4% loss against root (study, 2 seeds). On the tiny LM (300 steps, 4 seeds) one term
# costs +1.31%, two terms +0.19% (every seed positive) and BF16 nothing (-0.01%): root_fp4's
# momentum is BF16 (2 B/param), by that measurement; 'nvfp4x2' (1.125 B/param, AdamW-FP4's m and v
# together) and 'nvfp4' are there to choose (train.py --optimizer_states).
ROOT_STATES = ("fp32", "bf16", "nvfp4", "nvfp4x2")


def _momentum_state(buf, state, seed, shard=None):
    """ROOT's momentum entries for buf (FP32): {'momentum_buffer': ...} (FP32, BF16 or packed) and,
    for 'nvfp4x2', the second term 'momentum_residual' = Q(buf - Q(buf)), both packed dicts.
    shard: buf is this rank's rows; the entries are placed like the parameter."""
    if state == "fp32":
        return {"momentum_buffer": _placed(buf, shard)}
    if state == "bf16":  # round to nearest even, 2 B/param
        return {"momentum_buffer": _placed(buf.bfloat16(), shard)}
    if state == "nvfp4":
        return {"momentum_buffer": quantize_state(buf, "signed", seed=seed, shard=shard)}
    hi = quantize_state(buf, "signed", rounding="rn", shard=shard)
    if not is_packed(hi):  # a tensor quantizable() keeps in FP32: exact, no second term
        return {"momentum_buffer": hi}
    low = quantize_state(buf - dequantize_state(hi), "signed", rounding="rn", shard=shard)
    return {"momentum_buffer": hi, "momentum_residual": low}


def _momentum_value(st):
    """The FP32 momentum a state holds: its one term, or the sum of its two."""
    m = dequantize_state(st["momentum_buffer"]).float()
    return m + dequantize_state(st["momentum_residual"]) if "momentum_residual" in st else m


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
                         f"{tuple(p.shape)}: give 1-D, 3-D and embedding parameters to AdamW (muon.build does)")
    if ns == "nvfp4" and (p.shape[0] % 16 or p.shape[1] % 16):
        raise ValueError(f"ns='nvfp4' needs both dims divisible by 16, got a parameter of shape {tuple(p.shape)}")


# ---------------------------------------------------------------------------------------------
# build(model, name): which parameters each optimizer gets

OPTIMIZERS = ("adamw", "adamw_fp4", "muon", "root", "root_fp4", "torch_muon")


def build(model, name, lr=1.5e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, ns=None, states=None,
          **root_hyper):
    """The optimizer `name` (OPTIMIZERS) for a model, one object with torch's interface.
    'adamw': AdamW on everything (matrices decayed, 1-D parameters not), as model.configure_optimizers.
    'muon' / 'root' / 'root_fp4' / 'torch_muon': 2-D hidden weights on Muon / ROOT / ROOT with
    NVFP4 Newton-Schulz and BF16 momentum (ROOT_STATES says why) / torch.optim.Muon; embeddings,
    lm_head and 1-D parameters on AdamW. Both parts share lr and weight_decay: the Muon family's
    update is scaled to AdamW's RMS (update_scale 'rms'). For ablations, ns (NS_PRECISIONS)
    replaces the Muon family's Newton-Schulz precision and states (ROOT_STATES) its momentum's
    format, the AdamW part's too ('nvfp4' or 'nvfp4x2': AdamW's NVFP4 m and v; 'fp32' or 'bf16':
    torch's FP32 AdamW). root_hyper goes to ROOT (momentum, ns_steps, ...)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    if ns is not None and (name not in ("muon", "root", "root_fp4") or ns not in NS_PRECISIONS):
        raise ValueError(f"ns={ns!r}: one of {NS_PRECISIONS}, for muon, root or root_fp4 (not {name!r})")
    if states is not None and (name == "torch_muon" or states not in ROOT_STATES):
        raise ValueError(f"states={states!r}: one of {ROOT_STATES}, for any optimizer but torch_muon")
    if states in ("bf16", "nvfp4x2") and name in ("adamw", "adamw_fp4"):
        raise ValueError(f"states={states!r} is a format of ROOT's momentum; AdamW's states are 'fp32' or 'nvfp4'")
    fp4_states = states in ("nvfp4", "nvfp4x2") if states else name in ("adamw_fp4", "root_fp4")
    hidden, rest = _split_params(model)
    if name in ("adamw", "adamw_fp4"):
        return _adamw(_decay_groups(hidden + rest, weight_decay), lr, betas, eps, fp4_state=fp4_states)
    adamw = _adamw(_decay_groups(rest, weight_decay), lr, betas, eps, fp4_state=fp4_states)
    if name == "torch_muon":
        muon = torch.optim.Muon(hidden, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
    else:
        preset = dict(muon=dict(coefficients="muon", soft_threshold=None),
                      root=dict(coefficients="root", soft_threshold=0.9),
                      root_fp4=dict(coefficients="root", soft_threshold=0.9, ns="nvfp4", state="bf16"))[name]
        preset = {**preset, **({"ns": ns} if ns else {}), **({"state": states} if states else {})}
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
    """build()'s AdamW: torch's (fused, FP32 states), or this file's with NVFP4 states (SPEC 8.1)."""
    if fp4_state:
        return AdamW(groups, lr=lr, betas=betas, eps=eps, state="nvfp4")
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

    @property
    def state(self):  # every part's per-parameter state (state_bytes reads it)
        return {p: st for o in self.parts for p, st in o.state.items()}

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
