"""Tests of lora.py: the randomized SVD behind the fullstack recipe's L (SPEC 8.4), against
Halko, Martinsson and Tropp's bounds and torch.linalg.svd (CPU). Its wiring into FP4Linear:
test_linear.py."""
import math

import pytest
import torch

import lora


def _spectrum_matrix(m, n, s, seed):
    """A (m, n) = U diag(s) V^T with random orthonormal U, V."""
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(m, len(s), generator=g)).Q
    v = torch.linalg.qr(torch.randn(n, len(s), generator=g)).Q
    return (u * s) @ v.t()


def _halko_spectral_bound(s, k, p, q):
    """Halko, Martinsson, Tropp 2011: the expected spectral error E||(I - Q Q^T) A|| of the
    Gaussian range finder with k + p columns; q = 0 is Theorem 10.6, q > 0 Corollary 10.10:
    [(1 + sqrt(k/(p-1))) s_{k+1}^(2q+1) + e sqrt(k+p)/p (sum_{j>k} s_j^(2(2q+1)))^(1/2)]^(1/(2q+1))."""
    t = 2 * q + 1
    first = (1 + math.sqrt(k / (p - 1))) * s[k] ** t
    tail = math.e * math.sqrt(k + p) / p * float((s[k:] ** (2 * t)).sum().sqrt())
    return (first + tail) ** (1 / t)


@pytest.mark.parametrize("alpha, q", [(2.0, 0), (0.5, 2)])
def test_randomized_svd_within_halko_bounds(alpha, q):
    """Against torch.linalg.svd: the mean range-finder error over 8 fixed seeds stays under the
    expectation bound (Thm 10.6 / Cor 10.10, spectral; Thm 10.5, Frobenius: sqrt(1 + k/(p-1))
    times the tail), and per seed the rank-k factors obey the deterministic consequences:
    sigma_{k+1} <= ||A - U S V^T|| <= ||(I - QQ^T) A|| + sigma_{k+1} and |S_i - sigma_i| <=
    ||(I - QQ^T) A|| (Weyl). A broken range (any Q not fitted to A) errs by ~sigma_1 = 1."""
    m, n, k, p = 300, 200, 10, 6
    s = (1 + torch.arange(n, dtype=torch.float32)) ** -alpha
    a = _spectrum_matrix(m, n, s, seed=0)
    sigma = torch.linalg.svdvals(a.double())
    spec, frob = [], []
    for seed in range(8):
        qm = lora._range_finder(a, k + p, q, seed)
        resid = (a - qm @ (qm.t() @ a)).double()
        spec.append(float(torch.linalg.matrix_norm(resid, 2)))
        frob.append(float(resid.norm()))
        u, sv, v = lora.randomized_svd(a, k, oversample=p, power_iters=q, seed=seed)
        err = float(torch.linalg.matrix_norm((a - (u * sv) @ v.t()).double(), 2))
        slack = 1e-5  # FP32 rounding of the products
        assert sigma[k] - slack <= err <= spec[-1] + sigma[k] + slack, (seed, err, spec[-1], float(sigma[k]))
        assert float((sv.double() - sigma[:k]).abs().max()) <= spec[-1] + slack, seed
    bound = _halko_spectral_bound(sigma, k, p, q)
    assert sum(spec) / 8 <= bound and float(sigma[k + p]) <= min(spec), (sum(spec) / 8, bound)  # k+p columns
    if q == 0:
        frob_bound = math.sqrt(1 + k / (p - 1)) * float(sigma[k:].square().sum().sqrt())
        assert sum(frob) / 8 <= frob_bound, (sum(frob) / 8, frob_bound)


def test_randomized_svd_defaults_near_optimal_and_errors():
    """With the defaults (p = 16, q = 4) the rank-32 error of a slowly decaying spectrum is within
    3% of the optimum sigma_33 (Eckart-Young); bad arguments get clear errors."""
    s = (1 + torch.arange(256, dtype=torch.float32)) ** -0.5
    a = _spectrum_matrix(512, 256, s, seed=1)
    u, sv, v = lora.randomized_svd(a, 32)
    assert u.shape == (512, 32) and sv.shape == (32,) and v.shape == (256, 32)
    err = float(torch.linalg.matrix_norm(a - (u * sv) @ v.t(), 2))
    assert err <= 1.03 * float(s[32]), (err, float(s[32]))
    with pytest.raises(ValueError, match=r"rank must be in 1..min\(512, 256\) = 256, got 257"):
        lora.randomized_svd(a, 257)
    with pytest.raises(ValueError, match="2-D"):
        lora.randomized_svd(torch.randn(4, 4, 4), 2)
