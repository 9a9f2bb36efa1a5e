"""Tests of formats.py under hypothesis: the E2M1 and E4M3 codecs and the Hadamard rotation against
independent float64 / numpy statements of SPEC 1, 2 and 4 (not the code's own arithmetic).

The independent references and the input strategy here serve the other numerics tests too
(test_fp4, test_linear, test_optim, test_attention import them): one statement of each rule."""
import math
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import formats

# ---------------------------------------------------------------------------------------------
# Example counts: small enough for the suite's budget; FP4_FUZZ_SCALE=20 with
# HYPOTHESIS_PROFILE=fuzz (conftest.py) searches deeper.

FUZZ_SCALE = int(os.environ.get("FP4_FUZZ_SCALE", "1"))


def fuzz(examples):
    """settings for a numerics property test: `examples` examples (times FP4_FUZZ_SCALE)."""
    return settings(max_examples=examples * FUZZ_SCALE)


def first_mismatches(got, want, n=5):
    """A message with the first n positions where got != want (NaN == NaN)."""
    if got.shape != want.shape:  # no positions to compare (broadcasting would index out of range)
        return f"shapes differ: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}"
    bad = ~((got == want) | (torch.isnan(got.float()) & torch.isnan(want.float())))
    idx = bad.nonzero()[:n].tolist()
    return f"{int(bad.sum())} mismatches; first: " + ", ".join(
        f"{tuple(i)}: got {got[tuple(i)].item()} want {want[tuple(i)].item()}" for i in idx)


def assert_same(got, want):
    assert got.shape == want.shape, (got.shape, want.shape)
    same = (got == want) | (torch.isnan(got.float()) & torch.isnan(want.float()))
    assert bool(same.all()), first_mismatches(got, want)


# ---------------------------------------------------------------------------------------------
# Independent references (numpy, float64 unless said)

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # SPEC 1: magnitudes of codes 0..7
F32_MAX = float(np.finfo(np.float32).max)
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
F32_TINY = float(np.finfo(np.float32).smallest_subnormal)


def e2m1_nearest(v):
    """E2M1 codes (0..15) of float values by brute force: the nearest of the 8 magnitudes, a tie to
    the even code, +-6 beyond (saturating), code 0 for NaN; the sign bit iff v < 0 (SPEC 1)."""
    v = np.asarray(v, dtype=np.float64)
    a = np.minimum(np.nan_to_num(np.abs(v), nan=0.0, posinf=6.0), 6.0)
    d = np.abs(a[..., None] - E2M1)  # (..., 8)
    cand = d == d.min(-1, keepdims=True)
    even = (np.arange(8) % 2) == 0
    code = np.where(cand.sum(-1) == 2, np.argmax(cand & even, -1), np.argmax(cand, -1))
    return (code | np.where(v < 0, 8, 0)).astype(np.uint8)


def e2m1_value(codes):
    """float64 values of E2M1 codes."""
    codes = np.asarray(codes).astype(np.int64)
    return np.where(codes & 8, -1.0, 1.0) * E2M1[codes & 7]


def sr_code(v, r):
    """SPEC 4's stochastic rounding of float values v with random bytes r (0..255), in float64
    (exact: a * 256 / step is a power-of-two scaling of a float32): a = min(|v|, 6), step 0.5 /
    1 / 2 below 2 / 4 / above, |code value| = min(((floor(a 256 / step) + r) >> 8) step, 6)."""
    v = np.asarray(v, dtype=np.float64)
    a = np.minimum(np.nan_to_num(np.abs(v), nan=0.0), 6.0)
    step = np.where(a < 2, 0.5, np.where(a < 4, 1.0, 2.0))
    n = (np.floor(a * 256 / step).astype(np.int64) + np.asarray(r, dtype=np.int64)) >> 8
    mag = np.minimum(n * step, 6.0)
    return (np.searchsorted(E2M1, mag) | np.where(v < 0, 8, 0)).astype(np.uint8)


def _e4m3_table():
    """The 127 non-negative finite E4M3 values by bits 0x00..0x7E (SPEC 2: bias 7, 3 mantissa bits,
    subnormals m/8 2^-6, 0x7F is NaN), from the format's definition."""
    vals = []
    for bits in range(0x7F):
        e, m = bits >> 3, bits & 7
        vals.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(vals)


E4M3 = _e4m3_table()
E4M3_MAX = E4M3[-1]  # 448


def e4m3_nearest(t):
    """E4M3 bits of t >= 0 by brute force: the nearest value, a tie to the even bits, 448 beyond,
    0x7F for NaN."""
    t = np.asarray(t, dtype=np.float64)
    tc = np.minimum(np.nan_to_num(t, nan=0.0), E4M3_MAX)
    d = np.abs(tc[..., None] - E4M3)
    cand = d == d.min(-1, keepdims=True)
    even = (np.arange(len(E4M3)) % 2) == 0
    bits = np.where(cand.sum(-1) == 2, np.argmax(cand & even, -1), np.argmax(cand, -1))
    return np.where(np.isnan(t), 0x7F, bits).astype(np.uint8)


def e4m3_value(bits):
    bits = np.asarray(bits).astype(np.int64)
    return np.where(bits == 0x7F, np.nan, E4M3[np.minimum(bits, 0x7E)])


def f32(x):
    """float32 numpy array (IEEE float32 arithmetic from here on, independent of torch)."""
    return np.asarray(x, dtype=np.float32)


# ---------------------------------------------------------------------------------------------
# Inputs: shapes a recipe allows, and the values nobody plans for

KINDS = ("gauss", "wide", "zeros", "spike", "subnormal", "extreme", "ties")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@st.composite
def tensors(draw, rows=(1, 4), multiple=32, blocks=(1, 3), dtypes=DTYPES, kinds=KINDS, specials=True,
            row_multiple=1):
    """A (rows, K) tensor, K a multiple of `multiple`, of one of KINDS: Gaussian at a random binade;
    blocks spread over FP32's whole range; all zeros (signed); tiny values with one huge element;
    subnormals; +-max of FP32 and BF16 among others; E2M1 grid points and ties at a random binade.
    With specials, NaN / +-Inf at a few drawn positions."""
    r = draw(st.integers(*rows)) * row_multiple
    k = draw(st.integers(*blocks)) * multiple
    dtype = draw(st.sampled_from(dtypes))
    kind = draw(st.sampled_from(kinds))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = _fill(kind, r, k, g, draw(st.integers(-40, 40)))
    if specials and draw(st.booleans()):
        n = draw(st.integers(1, 3))
        for _ in range(n):
            i, j = draw(st.integers(0, r - 1)), draw(st.integers(0, k - 1))
            x[i, j] = draw(st.sampled_from([float("nan"), float("inf"), -float("inf")]))
    return x.to(dtype)


def _fill(kind, r, k, g, e):
    """Values of one kind (tensors' docstring); e: a binade for the kinds that take one."""
    if kind == "gauss":
        return torch.randn(r, k, generator=g) * 2.0**e
    if kind == "wide":  # every 16 elements their own binade, 2^-149 .. 2^126
        binades = torch.randint(-149, 127, (r, k // 16, 1), generator=g).float()
        return (torch.randn(r, k // 16, 16, generator=g) * torch.exp2(binades)).view(r, k)
    if kind == "zeros":
        return torch.where(torch.rand(r, k, generator=g) < 0.5, 0.0, -0.0)
    if kind == "spike":
        x = torch.randn(r, k, generator=g) * 2.0**-20
        x.view(-1)[torch.randint(0, r * k, (1,), generator=g)] = 2.0 ** (e * 3) * 1.7
        return x
    if kind == "subnormal":
        return torch.randn(r, k, generator=g) * 2.0**-140
    if kind == "extreme":
        pool = torch.tensor([F32_MAX, -F32_MAX, BF16_MAX, -BF16_MAX, 2.0**-126, F32_TINY, -F32_TINY, 0.0, 1.0])
        return pool[torch.randint(0, len(pool), (r, k), generator=g)]
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 3.0, 0.0, 7.0])
    x = ties[torch.randint(0, len(ties), (r, k), generator=g)] * torch.where(torch.rand(r, k, generator=g) < 0.5, 1.0, -1.0)
    x[:, ::16] = 6.0  # every block's amax 6: its scale maps the ties onto the grid exactly
    return x * 2.0**e


# ---------------------------------------------------------------------------------------------
# E2M1 (SPEC 1, 4)

floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


@fuzz(300)
@given(st.lists(floats32, min_size=1, max_size=64), st.integers(-8, 8))
def test_e2m1_rn_is_the_nearest_grid_point(vals, e):
    """e2m1_encode picks the nearest of the 16 signed grid points (ties to the even code,
    saturating, NaN -> 0), for any float: subnormals, ties at any binade, +-Inf."""
    v = torch.tensor(vals, dtype=torch.float32) * 2.0**e
    got = formats.e2m1_encode(v).numpy()
    want = e2m1_nearest(v.numpy())
    assert np.array_equal(got, want), _first(got, want, v.numpy())


@fuzz(300)
@given(st.lists(st.tuples(floats32, st.integers(0, 255)), min_size=1, max_size=64))
def test_e2m1_sr_is_spec_rule(pairs):
    """e2m1_encode_sr is SPEC 4's integer rule for every float and random byte."""
    v = torch.tensor([p[0] for p in pairs], dtype=torch.float32)
    r = torch.tensor([p[1] for p in pairs], dtype=torch.int32)
    got = formats.e2m1_encode_sr(v, r).numpy()
    want = sr_code(v.numpy(), r.numpy())
    want = np.where(np.isnan(v.numpy()), 0, want)  # NaN -> code 0 (the block scale is NaN)
    assert np.array_equal(got, want), _first(got, want, v.numpy())


# ---------------------------------------------------------------------------------------------
# E4M3 (SPEC 2)

@fuzz(300)
@given(st.lists(st.floats(min_value=0, width=32, allow_infinity=True) | st.just(float("nan")), min_size=1, max_size=64))
def test_e4m3_rn_is_the_nearest_value(vals):
    """e4m3_encode of t >= 0: the nearest E4M3 value (ties to even), 448 beyond, 0x7F for NaN."""
    t = torch.tensor(vals, dtype=torch.float32)
    got = formats.e4m3_encode(t).numpy()
    want = e4m3_nearest(t.numpy())
    assert np.array_equal(got, want), _first(got, want, t.numpy())


@fuzz(200)
@given(st.lists(st.tuples(st.floats(min_value=0, max_value=500, width=32), st.integers(0, 2**24 - 1)),
                min_size=1, max_size=64))
def test_e4m3_sr_rounds_to_a_neighbour_with_the_right_odds(pairs):
    """e4m3_encode_sr(t, u) is t's lower E4M3 neighbour lo or upper hi, hi iff u < (t - lo) / (hi - lo)
    (exact values on the grid stay; 448 beyond)."""
    t = torch.tensor([p[0] for p in pairs], dtype=torch.float32)
    u = torch.tensor([p[1] for p in pairs], dtype=torch.float32) * 2.0**-24
    got = e4m3_value(formats.e4m3_encode_sr(t, u).numpy())
    t64, u64 = t.double().numpy(), u.double().numpy()
    lo_i = np.searchsorted(E4M3, np.minimum(t64, E4M3_MAX), side="right") - 1
    lo, hi = E4M3[lo_i], E4M3[np.minimum(lo_i + 1, len(E4M3) - 1)]
    p = np.where(hi > lo, (np.minimum(t64, E4M3_MAX) - lo) / np.where(hi > lo, hi - lo, 1), 0.0)
    # p is formed in FP32 by the code: where u sits within 2^-22 of p either side is right
    sure_up, sure_down = u64 < p - 2.0**-22, u64 >= p + 2.0**-22
    assert np.all(np.where(sure_up, got == hi, True) & np.where(sure_down, got == lo, True)), (t64, u64, got)
    assert np.all((got == lo) | (got == hi))


# ---------------------------------------------------------------------------------------------
# E2M1 and packing, the SR hash and its random bytes: fixed cases

@pytest.mark.parametrize("x, want", [
    (0.0, 0.0), (0.24, 0.0), (0.25, 0.0), (0.26, 0.5), (0.5, 0.5), (0.74, 0.5), (0.75, 1.0),
    (1.0, 1.0), (1.25, 1.0), (1.26, 1.5), (1.5, 1.5), (1.74, 1.5), (1.75, 2.0), (2.0, 2.0),
    (2.5, 2.0), (2.51, 3.0), (3.0, 3.0), (3.49, 3.0), (3.5, 4.0), (4.0, 4.0), (5.0, 4.0),
    (5.01, 6.0), (6.0, 6.0), (7.0, 6.0), (1e30, 6.0), (float("inf"), 6.0), (1e-40, 0.0),
])
def test_e2m1_ties_and_boundaries(x, want):
    for sign in (1.0, -1.0):
        v = torch.tensor([sign * x])
        got = formats.e2m1_decode(formats.e2m1_encode(v)).item()
        assert got == sign * want or (want == 0 and got == 0), (sign * x, got)


def test_e2m1_codes_and_sign():
    grid = torch.tensor(formats.E2M1_GRID)
    assert_same(formats.e2m1_encode(grid), torch.arange(8, dtype=torch.uint8))
    assert_same(formats.e2m1_encode(-grid[1:]), torch.arange(9, 16, dtype=torch.uint8))
    assert formats.e2m1_encode(torch.tensor([-0.0, float("nan")])).tolist() == [0, 0]


def test_pack_all_256_bytes_round_trip():
    b = torch.arange(256, dtype=torch.uint8)
    codes = formats.unpack(b)
    assert codes.tolist()[:4] == [0, 0, 1, 0]  # byte 1: element 0 (low nibble) = 1
    assert_same(formats.pack(codes), b)
    assert_same(codes[0::2], b & 15)


def _lowbias32(x):  # an independent plain-Python statement of the mixer
    x ^= x >> 16
    x = (x * 0x7FEB352D) % 2**32
    x ^= x >> 15
    x = (x * 0x846CA68B) % 2**32
    return x ^ (x >> 16)


def test_hash_matches_plain_python():
    words = [0, 1, 2, 12345, 2**31 - 1, 2**31, 2**31 + 7, 2**32 - 1, 0xDEADBEEF]
    t = torch.tensor([w - 2**32 if w >= 2**31 else w for w in words], dtype=torch.int32)
    got = [v % 2**32 for v in formats._lowbias32_i32(t).tolist()]
    assert got == [_lowbias32(w) for w in words]
    for seed in (0, 7, 2**32 + 5):
        key = _lowbias32((seed % 2**32 + 0x9E3779B9) % 2**32)
        want = [(_lowbias32(i ^ key) >> 8) / 2**24 for i in range(64)]
        assert formats.uniform(seed, 64).tolist() == want


def test_uniform_is_uniform():
    u = formats.uniform(3, 1 << 20)
    assert 0 <= float(u.min()) and float(u.max()) < 1
    counts = torch.histc(u, bins=16, min=0, max=1)
    expected = u.numel() / 16
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 50, chi2  # 15 dof: P(chi2 > 50) < 1e-5
    assert abs(float(u.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / u.numel())


def test_random_bytes_layout():
    for seed in (0, 11, 2**32 + 3):
        key = _lowbias32((seed % 2**32 + 0x9E3779B9) % 2**32)
        want = [(_lowbias32((i // 4) ^ key) >> (8 * (i % 4))) & 0xFF for i in range(70)]
        assert formats.random_bytes(seed, 70).tolist() == want


def test_random_bytes_from_an_offset():
    """A shard's draws (start > 0) are the whole tensor's draws from that index on."""
    for seed in (0, 11, 2**32 + 3):
        whole = formats.random_bytes(seed, 70)
        for start in (1, 2, 3, 4, 5, 33, 69):
            assert torch.equal(formats.random_bytes(seed, 70 - start, start=start), whole[start:]), (seed, start)


# ---------------------------------------------------------------------------------------------
# Hadamard (SPEC 4)

def sylvester(n):
    """H_n, normalized, float64, from its recursive definition."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(n)


def rotate64(x, n, signs=None):
    """x (R, K) float64 with every n-block along K multiplied by diag(signs) H_n."""
    r, k = x.shape
    xb = x.reshape(r, k // n, n) * (1.0 if signs is None else np.asarray(signs, dtype=np.float64))
    return (xb @ sylvester(n)).reshape(r, k)


def hadamard_bound(x, n):
    """|fp32 - exact| per element of an FP32 rotation: log2(n) butterfly levels and one scaling, each
    a relative 2^-24 of the partial sums (at most sum |x| over the block / sqrt(n) after scaling):
    (log2(n) + 2) 2^-24 sum_block |x| / sqrt(n), plus FP32's subnormal spacing (R, K)."""
    r, k = x.shape
    mass = np.abs(x).reshape(r, k // n, n).sum(-1, keepdims=True) / math.sqrt(n)
    return np.broadcast_to((math.log2(n) + 2) * 2.0**-24 * mass + 4 * F32_TINY, (r, k // n, n)).reshape(r, k)


@fuzz(150)
@given(st.sampled_from(formats.HADAMARD_SIZES), st.booleans(), st.integers(0, 2**31),
       tensors(multiple=128, blocks=(1, 2), dtypes=(torch.float32,), specials=False))
def test_hadamard_is_the_sylvester_rotation(n, signed, seed, x):
    """hadamard(x, n, signs) equals the float64 x diag(s) H_n within FP32's derived bound wherever
    the block's partial sums stay below FP32's max (sum |x| <= max); above that, a block either
    still meets the bound or is non-finite (never a finite wrong value)."""
    signs = formats.random_signs(n, seed) if signed else None
    got = formats.hadamard(x, n, signs).double().numpy()
    x64 = x.double().numpy()
    want = rotate64(x64, n, None if signs is None else signs.numpy())
    ok = np.abs(got - want) <= hadamard_bound(x64, n)
    r, k = x.shape
    safe = np.broadcast_to(np.abs(x64).reshape(r, k // n, n).sum(-1, keepdims=True) <= F32_MAX, (r, k // n, n)).reshape(r, k)
    assert np.all(ok[safe]), _first(got[safe], want[safe], x64[safe])
    assert np.all(ok[~safe] | ~np.isfinite(got[~safe])), "a finite rotation off its bound"


@pytest.mark.parametrize("n", formats.HADAMARD_SIZES)
def test_hadamard_orthogonal_involution(n):
    h = formats.hadamard(torch.eye(n, dtype=torch.float64).float(), n).double()
    syl = torch.ones(1, 1, dtype=torch.float64)
    while syl.shape[0] < n:
        syl = torch.cat((torch.cat((syl, syl), 1), torch.cat((syl, -syl), 1)), 0)
    assert torch.allclose(h, syl / math.sqrt(n), atol=1e-7)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-6)
    x = torch.randn(8, 4 * n)
    assert torch.allclose(formats.hadamard(formats.hadamard(x, n), n), x, atol=1e-5)
    s = formats.random_signs(n, 11)
    y = formats.hadamard(x, n, s)
    back = (formats.hadamard(y, n).view(8, 4, n) * s).view_as(x)  # (x D H) H D = x
    assert torch.allclose(back, x, atol=1e-5)
    xa = torch.randn(4 * n, 3)
    assert torch.allclose(formats.hadamard(xa, n, axis=0), formats.hadamard(xa.t(), n).t())


def test_random_signs():
    s = formats.random_signs(128, 0)
    assert s.dtype == torch.float32 and set(s.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(s, formats.random_signs(128, 0))  # a pure function of the seed
    assert torch.equal(formats.random_signs(32, 5), formats.random_signs(128, 5)[:32])
    assert not torch.equal(s, formats.random_signs(128, 1))
    # balanced: over 64 seeds x 128 signs, the count of -1 is Binomial(8192, 1/2): sd 45.3, 5 sd
    neg = sum(int((formats.random_signs(128, seed) < 0).sum()) for seed in range(64))
    assert abs(neg - 4096) < 5 * 45.3
    with pytest.raises(ValueError, match="1 <= n <= 128"):
        formats.random_signs(256, 0)


def _first(got, want, x, n=5):
    """The first n positions where got != want, with the input there."""
    got, want, x = np.asarray(got).ravel(), np.asarray(want).ravel(), np.asarray(x).ravel()
    bad = np.nonzero(~((got == want) | (np.isnan(got.astype(np.float64)) & np.isnan(want.astype(np.float64)))))[0]
    return f"{len(bad)} mismatches; first: " + ", ".join(f"[{i}] x={x[i]!r} got {got[i]!r} want {want[i]!r}" for i in bad[:n])
