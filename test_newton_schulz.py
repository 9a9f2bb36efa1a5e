"""Tests of newton_schulz.py: the iteration (SPEC 8.2) in FP32, BF16 and NVFP4, its coefficient
table, and its replay as CUDA graphs (through ROOT, as train.py runs it)."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import fp4
import muon
import newton_schulz as ns
from newton_schulz import GraphedNS, MUON_COEFFICIENTS, NS_PRECISIONS, ROOT_COEFFICIENTS, newton_schulz, ns_coefficients
from test_optim import gpu

# ---------------------------------------------------------------------------------------------
# the iteration, its band, its precisions and designs


def known_svd(m, n, s, seed=0):
    """U diag(s) V^T (FP32) with Haar-random orthonormal U (m, k), V (n, k)."""
    g = torch.Generator().manual_seed(seed)
    k = len(s)
    u, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))
    s = torch.as_tensor(s, dtype=torch.float64)
    return ((u * s) @ v.T).float(), u, s, v


def polar_cos(X, G):
    """Cosine of X to the exact polar factor U V^T of G (FP64 SVD)."""
    u, _, vh = torch.linalg.svd(G.double(), full_matrices=False)
    P = u @ vh
    return float((X.double() * P).sum() / (X.double().norm() * P.norm()))


@pytest.mark.parametrize("shape", [(48, 80), (80, 48)])
def test_ns_fp32_is_the_iteration(shape):
    """fp32 = SPEC 8.2's formula, op for op: X = G/||G||_F (rows <= cols), A = X X^T, B = bA + cAA, X = aX + BX."""
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    a, b, c = MUON_COEFFICIENTS
    X = G.t() if shape[0] > shape[1] else G
    X = X / (X.norm() + 1e-7)
    for _ in range(5):
        A = X @ X.t()
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    want = X.t() if shape[0] > shape[1] else X
    got = newton_schulz(G, 5, MUON_COEFFICIENTS, "fp32")
    assert got.shape == G.shape and torch.equal(got, want)


# The band of Muon's quintic after 5 steps: f(s) = a s + b s^3 + c s^5 applied 5 times maps every
# normalized singular value in [0.01, 1] into [0.6818, 1.1344] (a grid of 4e5 points, exact
# polynomial in FP64); below 0.005 the band widens (up to 1.2024 from s in [0.002, 0.005]).
MUON_BAND = (0.6818, 1.1344)


def quintic(s, abc, steps=5):
    a, b, c = abc
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return s


def test_ns_known_svd_converges_into_the_band():
    s = torch.logspace(0, -1, 64, dtype=torch.float64)  # 1 ... 0.1; normalised: 0.27 ... 0.027
    G, u, s, v = known_svd(64, 160, s)
    X = newton_schulz(G, 5, MUON_COEFFICIENTS, "fp32").double()
    # the iteration keeps the singular vectors and maps each singular value by the quintic
    got = torch.diagonal(u.T @ X @ v)
    want = quintic(s / s.norm(), MUON_COEFFICIENTS)
    assert (s / s.norm()).min() > 0.01
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    assert (u.T @ X @ v - torch.diag(got)).abs().max() < 2e-5
    sv = torch.linalg.svdvals(X)
    assert MUON_BAND[0] - 1e-4 <= sv.min() and sv.max() <= MUON_BAND[1] + 1e-4, sv
    assert polar_cos(X, G) > 0.98


def test_ns_bf16_tracks_fp32():
    G = torch.randn(64, 192, generator=torch.Generator().manual_seed(2))
    x32 = newton_schulz(G, precision="fp32")
    x16 = newton_schulz(G, precision="bf16")
    # BF16 rounds X, A, B to 8 bits each step: ~1% elementwise, well under the band's 0.5 spread
    assert abs(polar_cos(x16, G) - polar_cos(x32, G)) < 0.005
    assert (x16 - x32).norm() / x32.norm() < 0.05


# nvfp4 quality bound, on a 128 x 384 Gaussian matrix (Marchenko-Pastur spectrum, the hard case:
# no dominant direction) and on a power-law spectrum. Measured (study/measure.py --sections ns, docs/fullstack.md):
# compensated_tail within 0.005 of bf16 on every 30m / 1b shape; here, bound 0.01 (the issue's
# goal). The naive cast must fail the same bound, or the test could not tell the designs apart.
def nv_inputs():
    g = torch.Generator().manual_seed(3)
    yield torch.randn(128, 384, generator=g)
    yield known_svd(128, 384, torch.arange(1, 129, dtype=torch.float64) ** -1.0)[0]


@pytest.mark.parametrize("which", [0, 1])
def test_ns_nvfp4_quality_bound(which):
    G = list(nv_inputs())[which]
    ref = polar_cos(newton_schulz(G, precision="bf16"), G)
    stats = {}
    X = newton_schulz(G, precision="nvfp4", design="compensated_tail", stats=stats)
    assert polar_cos(X, G) > ref - 0.01, (polar_cos(X, G), ref)
    assert torch.linalg.svdvals(X.double()).max() < 1.3  # the guard keeps the band (exact max 1.13)
    assert stats.keys() == {"nvfp4"}  # every GEMM in NVFP4
    if which == 0:
        naive = newton_schulz(G, precision="nvfp4", design="naive")
        assert polar_cos(naive, G) < ref - 0.01


def test_ns_nvfp4_gemms_reach_fp4_mm(monkeypatch):
    """Every GEMM of an FP4 step is one fp4.mm on NVFP4 QTensors quantized along the contraction
    dim; the BF16 tail steps use none. Per step: 'f' 3 (A, D^2, B'X), 'c' 6 (A: 2, D^2: 1, B'X: 3)."""
    m, n = 64, 160
    calls = []
    real_mm = fp4.mm

    def counting_mm(a, b, **kw):
        assert isinstance(a, fp4.QTensor) and isinstance(b, fp4.QTensor)
        assert a.fmt == b.fmt == "nvfp4"
        calls.append((a.lead_shape, b.lead_shape))
        return real_mm(a, b, **kw)

    monkeypatch.setattr(fp4, "mm", counting_mm)
    G = torch.randn(n, m, generator=torch.Generator().manual_seed(4))  # tall: transposed inside
    want = {"residual": 5 * 3, "compensated_tail": 3 * 3 + 2 * 6, "bf16_tail": 3 * 3, "naive": 5 * 3,
            "diagonal_tail": 1 * 3 + 4 * 7}
    for design, count in want.items():
        calls.clear()
        stats = {}
        newton_schulz(G, 5, MUON_COEFFICIENTS, "nvfp4", design, stats)
        assert len(calls) == count, design
        gram, square, prod = ((m, n), (m, n)), ((m, m), (m, m)), ((m, m), (n, m))
        assert set(calls) <= {gram, square, prod}  # contraction over n (Gram) or m (the rest)
        flops = sum(2 * a[0] * b[0] * a[1] for a, b in calls)
        assert stats["nvfp4"] == flops
        per_step = 4 * m * m * n + 2 * m**3
        assert stats.get("bf16", 0) == (2 * per_step if design == "bf16_tail" else 0)
    calls.clear()
    newton_schulz(G, 5, MUON_COEFFICIENTS, "bf16")
    assert not calls


class _Exact:
    """A stand-in QTensor holding exact values in mm's layout (the quantized axis last)."""
    def __init__(self, x, axis=-1):
        self.v = x.movedim(axis, -1)


@pytest.mark.parametrize("design", ["compensated_tail", "diagonal_tail"])
def test_ns_nvfp4_designs_are_the_iteration_in_exact_arithmetic(design, monkeypatch):
    """With exact products in place of the NVFP4 ones, a design's reformulation (residual shift,
    diagonal split, two-term operands) is the plain iteration: only FP32 rounding apart."""
    monkeypatch.setattr(ns, "_nv", lambda x, axis=-1: _Exact(x, axis))
    monkeypatch.setattr(ns, "_two_terms", lambda x, axis=-1: (_Exact(x, axis), _Exact(torch.zeros_like(x), axis)))
    monkeypatch.setattr(ns, "_nvmm", lambda qa, qb, stats: qa.v @ qb.v.t())
    for shape in [(48, 80), (80, 48)]:
        G = uneven(shape, 100.0, 0, seed=5)
        want = newton_schulz(G, 5, MUON_COEFFICIENTS, "fp32")
        got = newton_schulz(G, 5, MUON_COEFFICIENTS, "nvfp4", design)
        err = float((got - want).abs().max())
        assert err < 1e-5, f"{design} {shape}: max |diff| {err:.3g}"


def test_ns_coefficient_table():
    root = ROOT_COEFFICIENTS
    assert ns_coefficients((2048, 2048)) == root[(2048, 2048)] == (3.4916, -4.8224, 2.1095)
    assert ns_coefficients((8192, 2048)) == root[(2048, 8192)]  # W and W^T alike
    assert ns_coefficients((2048, 16384), "root") == (3.1943, -3.8221, 1.5322)
    assert ns_coefficients((640, 1792)) == MUON_COEFFICIENTS  # not in the table
    assert ns_coefficients((2048, 2048), "muon") == MUON_COEFFICIENTS
    assert ns_coefficients((4, 4), (1.5, -0.5, 0.0)) == (1.5, -0.5, 0.0)
    with pytest.raises(ValueError, match="coefficients"):
        ns_coefficients((4, 4), "polar")


# ---------------------------------------------------------------------------------------------
# uneven rows and columns: momentum has rows (output channels) that carry most of the gradient.
# The bound: the default nvfp4 design within 0.005 of BF16's cosine to U V^T on inputs whose row or
# column norms spread up to 1000:1, wide, tall and square (docs/newton_schulz_uneven.md measures
# it at the model's shapes). compensated_tail, the default before, misses it by up to 8x here.

UNEVEN_BOUND = 0.005
UNEVEN_SHAPES = [(64, 192), (192, 64), (128, 128)]  # wide, tall (transposed inside), square


def uneven(shape, spread, axis, seed):
    """A Gaussian matrix whose rows (axis 0) or columns (axis 1) are scaled by norms log-uniform
    over [1/spread, 1], both ends taken: the spread is exactly `spread`."""
    g = torch.Generator().manual_seed(seed)
    Z = torch.randn(*shape, generator=g, dtype=torch.float64)
    u = torch.rand(shape[axis], generator=g, dtype=torch.float64)
    u = (u - u.min()) / (u.max() - u.min())
    w = spread ** -u
    return (Z * (w[:, None] if axis == 0 else w[None, :])).float()


def uneven_gap(G, design=ns.NS_DESIGN):
    """nvfp4 `design`'s cosine to the exact polar factor minus BF16's (both Muon's coefficients)."""
    return polar_cos(newton_schulz(G, precision="nvfp4", design=design), G) - polar_cos(newton_schulz(G, precision="bf16"), G)


def test_ns_nvfp4_uneven_rows_and_columns_bound():
    """The default design holds the bound at 1000:1 on every shape, axis and seed; the design
    without the diagonal split (and with a two-step tail) does not. pytest -s prints the table."""
    rows = []
    for shape in UNEVEN_SHAPES:
        for axis in (0, 1):
            for seed in range(3):
                G = uneven(shape, 1000.0, axis, seed)
                rows.append((shape, "rows" if axis == 0 else "cols", seed, uneven_gap(G), uneven_gap(G, "compensated_tail")))
    print(f"\n{'shape':>10} {'spread on':>9} {'seed':>4} {ns.NS_DESIGN + ' - bf16':>22} {'compensated_tail - bf16':>24}")
    for shape, where, seed, new, old in rows:
        print(f"{shape[0]:>4}x{shape[1]:<5} {where:>9} {seed:>4} {new:>+22.4f} {old:>+24.4f}")
    bad = [r for r in rows if abs(r[3]) > UNEVEN_BOUND]
    assert not bad, f"{ns.NS_DESIGN} misses the bound {UNEVEN_BOUND} on {len(bad)} inputs, first: {bad[:3]}"
    old_missed = [r for r in rows if abs(r[4]) > UNEVEN_BOUND]
    assert len(old_missed) == len(rows) and min(r[4] for r in rows) < -0.03  # the inputs are hard


@settings(max_examples=8, deadline=None, derandomize=True)
@given(shape=st.sampled_from(UNEVEN_SHAPES + [(64, 64), (32, 160)]), axis=st.integers(0, 1),
       log_spread=st.floats(0.0, 3.0), seed=st.integers(0, 2**16))
def test_ns_nvfp4_uneven_bound_property(shape, axis, log_spread, seed):
    """For any spread up to 1000:1 (log-uniform row or column norms), shape and draw: within the
    bound of BF16's cosine, above or below."""
    G = uneven(shape, 10.0 ** log_spread, axis, seed)
    gap = uneven_gap(G)
    assert abs(gap) <= UNEVEN_BOUND, (shape, axis, 10.0 ** log_spread, seed, gap)


# ---------------------------------------------------------------------------------------------
# Newton-Schulz as CUDA graphs

def _root_run(ns_graph, shapes, steps=3, device="cuda"):
    """ROOT with ns='nvfp4' for `steps` steps on fixed parameters and gradients of `shapes`."""
    g = torch.Generator(device=device).manual_seed(11)
    ps = [torch.nn.Parameter(torch.randn(*s, generator=g, device=device)) for s in shapes]
    grads = [[torch.randn(*s, generator=g, device=device) for s in shapes] for _ in range(steps)]
    opt = muon.ROOT(ps, lr=0.02, ns="nvfp4", state="bf16", ns_graph=ns_graph)
    for step in grads:
        for p, gr in zip(ps, step):
            p.grad = gr.clone()
        opt.step()
    return [p.detach() for p in ps], opt


def test_graphed_ns_off_the_gpu_is_newton_schulz():
    """GraphedNS falls through to newton_schulz where no graph applies (CPU, or not nvfp4)."""
    G = torch.randn(32, 48, generator=torch.Generator().manual_seed(3))
    ns = GraphedNS()
    for precision in NS_PRECISIONS:
        assert torch.equal(ns(G, 5, MUON_COEFFICIENTS, precision),
                           newton_schulz(G, 5, MUON_COEFFICIENTS, precision))
    assert ns.graphs == {}
    (plain,), _ = _root_run(False, [(32, 48)], steps=2, device="cpu")
    (graphed,), _ = _root_run(True, [(32, 48)], steps=2, device="cpu")
    assert torch.equal(plain, graphed)
    with pytest.raises(TypeError, match="ns_graph"):
        muon.ROOT([torch.nn.Parameter(torch.zeros(16, 16))], ns_graph="yes")


@gpu
def test_graphed_ns_replays_the_same_update_on_gpu():
    """ROOT's nvfp4 Newton-Schulz replayed as CUDA graphs gives the eager run's weights bit for
    bit (the same kernels on the same values), one graph per shape (two matrices share one)."""
    shapes = [(128, 384), (256, 128), (128, 384)]
    eager, _ = _root_run(False, shapes)
    graphed, opt = _root_run(True, shapes)
    assert len(opt._ns.graphs) == 2 and all(v is not None for v in opt._ns.graphs.values())
    for i, (a, b) in enumerate(zip(eager, graphed)):
        assert torch.equal(a, b), f"param {i}: max |diff| {float((a - b).abs().max()):.3g}"
