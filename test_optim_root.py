"""Tests of optim.py's Muon and ROOT (the Muon family's optimizers; AdamW and the FP4 states: test_optim.py;
Newton-Schulz itself: test_newton_schulz.py)."""
import math

import pytest
import torch

import optim
from test_optim import gpu


# ---------------------------------------------------------------------------------------------
# Muon and ROOT (Newton-Schulz itself: test_newton_schulz.py)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("kind", ["gauss", "ties", "zeros", "inf_nan", "wide", "signed"])
def test_kth_smallest_is_kthvalue(kind, device):
    """optim.kth_smallest (torch.topk of the smaller side) gives torch.kthvalue's value exactly, on
    the CPU and on a GPU (against the CPU's kthvalue): ties, zeros, Inf and NaN (ordered last, as
    kthvalue orders them; a NaN among the top ones must not come out unless it is the k-th),
    subnormal to huge magnitudes, signed values; k at both ends, at ROOT's 0.9, at random."""
    g = torch.Generator().manual_seed(["gauss", "ties", "zeros", "inf_nan", "wide", "signed"].index(kind))
    for n in (1, 2, 17, 1000, 4099):
        x = torch.randn(n, generator=g).abs()
        if kind == "ties":
            x = (x * 4).round() / 4
        elif kind == "zeros":
            x[torch.rand(n, generator=g) < 0.3] = 0.0
        elif kind == "inf_nan":
            x[torch.rand(n, generator=g) < 0.05] = float("inf")
            x[torch.rand(n, generator=g) < 0.05] = float("nan")
        elif kind == "wide":
            x = x * torch.exp2(torch.randint(-140, 120, (n,), generator=g).float())
        elif kind == "signed":
            x = x * torch.randn(n, generator=g).sign()
        for k in {1, n, max(1, math.ceil(0.9 * n)), int(torch.randint(1, n + 1, (1,), generator=g))}:
            want, got = x.kthvalue(k).values, optim.kth_smallest(x.to(device), k).cpu()
            assert got.shape == () and (torch.equal(got, want) or (got.isnan() and want.isnan())), (n, k, got, want)
    with pytest.raises(ValueError, match="1 <= k <= numel"):
        optim.kth_smallest(torch.ones(4), 5)
    with pytest.raises(ValueError, match="1-D float32"):
        optim.kth_smallest(torch.ones(4, dtype=torch.float64), 1)


def test_soft_threshold():
    M = torch.randn(40, 50, generator=torch.Generator().manual_seed(5))
    M[3, 7] = 100.0  # an outlier
    B = optim.soft_threshold(M, 0.9)
    eps = M.abs().flatten().sort().values[math.ceil(0.9 * M.numel()) - 1]
    assert B.abs().max() == eps
    assert torch.equal(B, M.clamp(-eps, eps))
    kept = (B == M).float().mean()
    assert 0.9 <= kept <= 0.9 + 1 / M.numel()  # ties aside, exactly the top 10% are clipped
    assert torch.equal(optim.soft_threshold(M, 0.5), M.clamp(-M.abs().median(), M.abs().median()))
    assert optim.soft_threshold(M, None) is M and optim.soft_threshold(M, 1.0) is M


def test_root_step_is_the_formula():
    """Two steps of ROOT on one matrix against SPEC 8.2 written out: EMA momentum, Nesterov,
    soft threshold, NS with the shape's coefficients, weight decay, RMS-matching scale."""
    g = torch.Generator().manual_seed(6)
    w0 = torch.randn(32, 48, generator=g)
    grads = [torch.randn(32, 48, generator=g) for _ in range(2)]
    p = torch.nn.Parameter(w0.clone())
    opt = optim.ROOT([p], lr=0.01, momentum=0.9, weight_decay=0.1, soft_threshold=0.8, ns="fp32")
    w, buf = w0.clone(), torch.zeros_like(w0)
    for grad in grads:
        p.grad = grad.clone()
        opt.step()
        buf = 0.9 * buf + 0.1 * grad
        u = optim.soft_threshold(0.9 * buf + 0.1 * grad, 0.8)
        O = optim.newton_schulz(u, 5, optim.MUON_COEFFICIENTS, "fp32")
        w = w * (1 - 0.01 * 0.1) - 0.01 * 0.2 * math.sqrt(48) * O
    torch.testing.assert_close(p.detach(), w, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], buf, atol=1e-7, rtol=1e-6)
    assert optim.update_scale((32, 48), "shape") == 1.0 and optim.update_scale((48, 32), "shape") == math.sqrt(1.5)


def test_root_two_term_momentum():
    """state='nvfp4x2': m ~ Q(m) + Q(m - Q(m)), both rounded to nearest. The second term quantizes
    the first's error r (|r| ~ d |m|, d = one term's relative error) with its own 16-block scales,
    so what is left is ~ d |r| ~ d^2 |m|: with d ~ 0.1 (NVFP4 on Gaussian data) about a tenth of
    one term's error; the bound, a quarter, leaves margin. Twice one term's bytes; a tensor too
    small to quantize stays one FP32 entry. The step uses the sum."""
    g = torch.Generator().manual_seed(7)
    m = torch.randn(256, 512, generator=g) * torch.exp(torch.randn(256, 1, generator=g))  # rows of unlike scale
    one = optim._momentum_state(m, "nvfp4", 3)
    two = optim._momentum_state(m, "nvfp4x2", 3)
    rel = lambda st: float((optim._momentum_value(st) - m).norm() / m.norm())  # noqa: E731
    print(f"relative error: one term {rel(one):.4f}, two terms {rel(two):.4f}")
    assert 0.05 < rel(one) < 0.2 and rel(two) < 0.25 * rel(one)
    assert set(two) == {"momentum_buffer", "momentum_residual"} and all(optim.is_packed(v) for v in two.values())
    assert optim.state_nbytes(two["momentum_buffer"]) == optim.state_nbytes(one["momentum_buffer"]) == m.numel() * 9 // 16 + 4
    small = optim._momentum_state(torch.ones(8, 24), "nvfp4x2", 0)
    assert set(small) == {"momentum_buffer"} and torch.equal(small["momentum_buffer"], torch.ones(8, 24))
    p = torch.nn.Parameter(torch.zeros(64, 128))
    opt = optim.ROOT([p], lr=0.01, ns="fp32", state="nvfp4x2", soft_threshold=None)
    p.grad = m[:64, :128].clone()
    opt.step()  # from zero momentum: m = 0.05 g held in two terms, the update from 0.95 m + 0.05 g
    held = optim._momentum_value(opt.state[p])
    assert float((held - 0.05 * p.grad).norm() / (0.05 * p.grad).norm()) < 0.25 * rel(one)
    assert optim.state_bytes(opt) == 2 * (64 * 128 * 9 // 16 + 4)


def test_root_bad_input():
    with pytest.raises(ValueError, match="1-D parameter of shape"):
        optim.ROOT([torch.nn.Parameter(torch.zeros(8))])
    with pytest.raises(ValueError, match="3-D parameter of shape"):
        optim.ROOT([torch.nn.Parameter(torch.zeros(2, 8, 8))])
    with pytest.raises(ValueError, match="divisible by 16"):
        optim.ROOT([torch.nn.Parameter(torch.zeros(24, 32))], ns="nvfp4")
    p = [torch.nn.Parameter(torch.zeros(16, 16))]
    for bad, match in [(dict(ns="fp8"), "ns must be"), (dict(state="int8"), "state must be"),
                       (dict(soft_threshold=1.5), "soft_threshold"), (dict(momentum=1.0), "momentum"),
                       (dict(coefficients="x"), "coefficients"), (dict(scale="spectral"), "scale rule"),
                       (dict(ns_design="cast"), "ns_design"), (dict(lr=-1.0), "lr")]:
        with pytest.raises(ValueError, match=match):
            optim.ROOT(p, **bad)
    with pytest.raises(ValueError, match="2-D tensor"):
        optim.newton_schulz(torch.zeros(4, 4, 4))
    with pytest.raises(ValueError, match="precision"):
        optim.newton_schulz(torch.zeros(16, 16), precision="fp16")
    with pytest.raises(TypeError, match="floating-point"):
        optim.newton_schulz(torch.zeros(16, 16, dtype=torch.int32))
    G = torch.randn(16, 32)
    G[0, 0] = float("nan")
    assert optim.newton_schulz(G, precision="nvfp4").isnan().any()  # NaN propagates
    for precision in optim.NS_PRECISIONS:  # a zero gradient gives a zero update, not NaN
        assert torch.equal(optim.newton_schulz(torch.zeros(16, 32), precision=precision), torch.zeros(16, 32))
