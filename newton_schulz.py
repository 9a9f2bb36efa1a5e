"""
Newton-Schulz orthogonalisation for the Muon family (SPEC.md 8.2): the quintic iteration toward
the polar factor of a matrix, in FP32, BF16 or with its GEMMs on NVFP4 operands, and its replay as
CUDA graphs. muon.py's Muon and ROOT call it; so do bench.py and measure.py.

Read top to bottom: the iteration and its coefficients, the NVFP4 designs step by step, then the
CUDA-graph replay.
"""
import os

import torch

import fp4

# ---------------------------------------------------------------------------------------------
# Newton-Schulz (SPEC 8.2)
#
# newton_schulz(G) approximates the polar factor U V^T of G = U S V^T with the quintic iteration
# (SPEC 8.2): X = G / ||G||_F (transposed so rows <= cols), then per step A = X X^T,
# B = b A + c A A, X = a X + B X. The map on each singular value, f(s) = a s + b s^3 + c s^5,
# sends (0, 1] into a band around 1 (Muon's coefficients: about [0.68, 1.2]) rather than to 1.
#
# precision='nvfp4' runs the GEMMs on NVFP4 operands (fp4.quantize along the contraction dim,
# fp4.mm). Casting the three GEMMs of every step diverges (SPEC 8.2); the measurements that chose
# the design below are in docs/fullstack.md, "Muon and ROOT" (study/measure.py --sections ns).
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
# - a diagonal shift for uneven rows (design 'diagonal_tail', the default; docs/newton_schulz_uneven.md):
#   with row norms r_i spread 1000:1, A_ii = r_i^2 is far below mu for small rows, so D = A - mu I
#   carries -mu on their diagonal and rounds their off-diagonal entries (and B'_ii + beta, which
#   must nearly cancel) to 4 bits of mu: ~8% noise a step on exactly the rows still growing.
#   Split A = diag(d) + O instead (d_i = |x_i|^2 in FP32, O the off-diagonal part) and quantize only
#   O; then B = bA + cA^2 = diag(b d + c d^2 + c rowsum(O^2)) + [b O + c O.(d_i + d_k) + c offdiag(O O)],
#   the diagonal multiplies X's rows in FP32 (a per-row scale: a GEMM epilogue, SPEC 8.2), and O O
#   and offdiag(B) X run in NVFP4. What is left is the small singular directions' noise: with
#   spread, errors of every step but the first stay visible (column spread, a few rows 1000x the
#   rest), so all steps after the first are compensated, with all three products two-term (O O
#   like the Gram: 2 GEMMs).

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
# How each step of an nvfp4 iteration runs, per design (measured in docs/fullstack.md):
#   'n' naive: Muon's form, A, A A and B X each one NVFP4 GEMM, no guard
#   'f' residual form + guard, one NVFP4 GEMM per product
#   'c' residual form + guard, compensated (two-term) operands, all GEMMs NVFP4
#   'g' BF16 (the plain bf16 step) + guard
#   'd' diagonal shift + guard, one NVFP4 GEMM per product
#   'k' diagonal shift + guard, compensated operands in all three products
NS_DESIGNS = {  # (mode of the first steps, mode of the last steps, how many last steps)
    "naive": ("n", "n", 2),
    "residual": ("f", "f", 2),
    "bf16_tail": ("f", "g", 2),
    "compensated_tail": ("f", "c", 2),
    "diagonal_tail": ("d", "k", 4),
}
NS_DESIGN = "diagonal_tail"  # the default of precision='nvfp4' (newton_schulz, ROOT, GraphedNS)
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
                  design=NS_DESIGN, stats=None):
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
    head, tail, k = NS_DESIGNS[design]
    k = min(k, steps)
    return head * (steps - k) + tail * k


def _count(stats, precision, flops):
    if stats is not None:
        stats[precision] = stats.get(precision, 0) + flops


def _step_fp32(X, abc, stats):
    a, b, c = abc
    m, n = X.shape
    with fp4.ieee_fp32(X.device):  # precision='fp32' means FP32, also under train.py's TF32
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
    return (a + beta) * X + _product(Bp, X, compensated, stats)


def _step_diagonal(X, abc, stats, compensated=False):
    """One guarded step with A's diagonal split off (the section's header): 3 NVFP4 GEMMs, or 7
    compensated (A: 2, O O: 2, offdiag(B) X: 3)."""
    a, b, c = abc
    X, A = _guard(X, _gram(X, compensated, stats))
    d = (X * X).sum(1)  # (m,) diag(X X^T) in FP32: an O(mn) reduction, not a GEMM
    O = A - torch.diag_embed(torch.diagonal(A))  # (m, m) symmetric, zero diagonal
    O2 = _gram(O, compensated, stats)  # O O = O O^T
    diag_b = b * d + c * d * d + c * (O * O).sum(1)  # diag(B): diag(O^2)_i = sum_k O_ik^2
    Ob = b * O + c * O * (d[:, None] + d[None, :]) + c * O2  # diag(d) O + O diag(d) = O.(d_i + d_k)
    Ob = Ob - torch.diag_embed(torch.diagonal(Ob))
    return (a + diag_b)[:, None] * X + _product(Ob, X, compensated, stats)


def _product(M, X, compensated, stats):
    """M X (M (m, m), X (m, n)) on NVFP4 operands quantized along m; compensated: 3 GEMMs of two
    terms each (the Q2 Q2 term dropped)."""
    if not compensated:
        return _nvmm(_nv(M), _nv(X, axis=0), stats)
    m1, m2 = _two_terms(M)
    x1, x2 = _two_terms(X, axis=0)  # X^T along m: (n, m)
    return _nvmm(m1, x1, stats) + _nvmm(m1, x2, stats) + _nvmm(m2, x1, stats)


_NS_STEPS = {
    "e": _step_fp32, "b": _step_bf16, "n": _step_naive,
    "g": lambda X, abc, stats: _step_bf16(X, abc, stats, guard=True),
    "f": _step_residual, "c": lambda X, abc, stats: _step_residual(X, abc, stats, compensated=True),
    "d": _step_diagonal, "k": lambda X, abc, stats: _step_diagonal(X, abc, stats, compensated=True),
}


# ---------------------------------------------------------------------------------------------
# Newton-Schulz replayed as a CUDA graph
# An nvfp4 step launches ~100 small kernels (each quantize's amax pre-pass and scale ops, the
# dequantizes, the guard's power iteration): at 30M the host sets root_fp4's pace (55K tokens/s
# against root's 170K in the study, the same GPU work otherwise). The iteration is a pure function
# of its input (round-to-nearest NVFP4: no seeds; no lr), so each shape's is captured once and
# replayed: the same kernels on the same values.

# ROOT's ns_graph default: on (the H200: train.py 30M bf16 + root_fp4 at 277,938 tokens/s against
# 72,892 without, +0.2 GiB; results/nvidia-h200/optim/train_30m_root_fp4_ns_graph_*.log); FP4_NS_GRAPH=0 turns it off
NS_GRAPH = os.environ.get("FP4_NS_GRAPH", "1") == "1"


class GraphedNS:
    """newton_schulz(u, steps, coefficients, precision, design) with nvfp4 on a GPU as one CUDA
    graph per (shape, dtype, device, arguments); anything else runs newton_schulz directly. The
    result of a graphed call is the graph's own output buffer: use it before the next call with
    the same shape (ROOT does). The graphs share one memory pool, replayed one at a time. If a
    capture fails, a warning says why and that shape runs eagerly from then on."""

    def __init__(self):
        self.graphs, self.pool = {}, None

    def __call__(self, u, steps, coefficients, precision, design=NS_DESIGN):
        if precision != "nvfp4" or not u.is_cuda or torch.cuda.is_current_stream_capturing():
            return newton_schulz(u, steps, coefficients, precision, design)
        key = (tuple(u.shape), u.dtype, u.device, steps, tuple(coefficients), design)
        if key not in self.graphs:
            self.graphs[key] = self._capture(u, key)
        entry = self.graphs[key]
        if entry is None:  # its capture failed: eager
            return newton_schulz(u, steps, coefficients, precision, design)
        static_in, graph, static_out = entry
        static_in.copy_(u)
        graph.replay()
        return static_out

    def _capture(self, u, key):
        _, _, _, steps, abc, design = key
        static_in = u.detach().clone()
        side = torch.cuda.Stream(u.device)
        side.wait_stream(torch.cuda.current_stream(u.device))
        with torch.cuda.stream(side):  # warm up off the capture: kernels compiled, cuBLAS ready
            newton_schulz(static_in, steps, abc, "nvfp4", design)
        torch.cuda.current_stream(u.device).wait_stream(side)
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                static_out = newton_schulz(static_in, steps, abc, "nvfp4", design)
        except RuntimeError as err:
            import warnings
            warnings.warn(f"newton_schulz.GraphedNS: capturing Newton-Schulz for shape {key[0]} failed ({err}); "
                          f"that shape runs eagerly")
            return None
        return static_in, graph, static_out
