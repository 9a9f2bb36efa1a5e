"""The first-use self-checks (selfcheck.py, fp4.py's checks) on the CPU: Blackwell's native GEMM
and cvt.rs SR encoder are emulated here from their documented layouts, then broken the ways a
layout error would break them; each fault must be caught, and the fallback must give the
reference's bits."""
import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

import formats
import fp4
import linear
import selfcheck

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def fresh():
    selfcheck.reset()  # each test is a fresh process for the cache
    yield
    selfcheck.reset()


# --- a CPU stand-in of torch.nn.functional.scaled_mm on Blackwell (SPEC 7) -----------------------

def cublas_scales(flat, rows, cols, fault):
    """Scale (r, c) of cuBLAS's 1D block-scaling layout: 128x4 tiles of 512 bytes, row-major over
    tiles, inside a tile at (r % 32) * 16 + (r % 128) // 32 * 4 + c % 4. fault 'tiles': the tile
    read transposed (c % 4) * 128 + r % 128."""
    cp = -(-cols // 4) * 4
    r, c = torch.arange(rows).view(-1, 1), torch.arange(cols).view(1, -1)
    inner = (c % 4) * 128 + r % 128 if fault == "tiles" else (r % 32) * 16 + (r % 128) // 32 * 4 + c % 4
    return flat[((r // 128) * (cp // 4) + c // 4) * 512 + inner]


def fp4_values(codes, scales, fault):
    """Packed codes (rows, K/2) and swizzled scales -> values, as the hardware reads them: element
    2i in the low nibble (fault 'nibbles': the high one)."""
    lo, hi = codes & 15, codes >> 4
    if fault == "nibbles":
        lo, hi = hi, lo
    c = torch.stack([lo, hi], -1).flatten(-2).long()  # (rows, K)
    v = E2M1[c & 7] * torch.where(c >= 8, -1.0, 1.0)
    bits = scales.view(torch.uint8)
    if scales.dtype == torch.float8_e8m0fnu:  # E8M0: 2^(e - 127), 0xFF NaN
        per = torch.where(bits == 255, float("nan"), torch.exp2(bits.double() - 127))
    else:
        per = bits.view(torch.float8_e4m3fn).double()
    bs = 32 if scales.dtype == torch.float8_e8m0fnu else 16
    s = cublas_scales(per, c.shape[0], c.shape[1] // bs, fault)
    return v.double() * s.repeat_interleave(bs, 1)


def native_standin(fault=None, calls=None):
    def scaled_mm(mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, swizzle_a, swizzle_b, output_dtype):
        if calls is not None:
            calls.append(1)
        # The nibble fault hits the transposed operand only: the same swap in both operands permutes
        # the contraction inside each block alike and leaves every product unchanged (harmless).
        a = fp4_values(mat_a.view(torch.uint8), scale_a, "tiles" if fault == "tiles" else None)
        b = fp4_values(mat_b.t().view(torch.uint8), scale_b, fault)  # mat_b is (K/2, N), column-major
        return (a @ b.t()).to(output_dtype)
    return scaled_mm


def use_native(monkeypatch, fault=None, calls=None):
    monkeypatch.setattr(torch.nn.functional, "scaled_mm", native_standin(fault, calls))
    monkeypatch.setattr(fp4, "mm_backend", lambda fmt, device: "native")


def test_native_standin_passes_and_is_checked_once_a_process(monkeypatch):
    """The right layout passes; later uses are a cache hit (the GEMM is not run again)."""
    calls = []
    use_native(monkeypatch, calls=calls)
    for _ in range(5):
        assert fp4.checked_backend("native", torch.device("cpu")) == "native"
    assert len(calls) == 4  # the check's GEMMs (mxfp4, nvfp4; BF16 and FP32 outputs), once
    assert selfcheck.summary()["fallbacks"] == {} and "mm.native on cpu" in selfcheck.summary()["verified"]
    assert any("mm.native on cpu: verified" in line for line in selfcheck.LOG)


@pytest.mark.parametrize("fault", ["nibbles", "tiles"])
def test_native_layout_fault_is_caught_and_falls_back_to_reference_bits(monkeypatch, fault):
    use_native(monkeypatch, fault)
    a, b = fp4.mm_probe("mxfp4")
    with pytest.warns(RuntimeWarning, match=r"mm\.native on cpu .*FAILED.*got .*want"):
        got = fp4.mm(a, b, torch.float32)  # the default backend: native, checked on first use
    want = fp4.mm(a, b, torch.float32, backend="emulated")
    assert not selfcheck.mismatches(got, want)
    assert list(selfcheck.summary()["fallbacks"]) == ["mm.native on cpu"]
    assert fp4.checked_backend("native", torch.device("cpu")) == "bf16"  # cached: no second warning


# --- a CPU stand-in of cvt.rs.satfinite.e2m1x4.f32 (SPEC 4) ------------------------------------

def cvt_rs(v, r, order):
    """The PTX rule: add the random byte to the 8 bits below the kept mantissa, round away from
    zero on the carry. Element k of each 4 takes byte order[k] of the word (r holds byte i mod 4
    at element i, the reference's layout)."""
    r = r.reshape(-1, 4)[:, order].reshape(v.shape).double()
    a = v.abs().clamp(max=6.0).double()
    s = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    lo = torch.floor(a / s) * s
    frac = torch.floor((a - lo) / s * 256)  # the discarded bits, as 8 bits
    mag = (lo + s * (frac + r >= 256)).clamp(max=6.0).nan_to_num(0.0)
    code = torch.searchsorted(E2M1.double(), mag).to(torch.uint8)
    return code | torch.where(v < 0, 8, 0).to(torch.uint8)


def sr_standin(order, monkeypatch):
    def quantize_fn(x, xm, fmt, **o):
        with monkeypatch.context() as m:
            m.setattr(fp4, "e2m1_encode_sr", lambda v, r: cvt_rs(v, r, order))
            return fp4.quantize(x, fmt, **o)
    return quantize_fn


def test_cvt_rs_probe_one_element_at_1_25():
    """SPEC 4's probe: 1.25 with random byte 0x80 rounds up to 1.5; with byte 0 it stays 1.0."""
    v = torch.tensor([[1.25, 1.25, 1.25, 1.25]])
    r = torch.tensor([[0x80, 0, 0, 0]])
    assert cvt_rs(v, r, [0, 1, 2, 3]).tolist() == [[3, 2, 2, 2]]
    assert cvt_rs(v, r, [3, 2, 1, 0]).tolist() == [[2, 2, 2, 3]]


def test_sr_check_accepts_the_right_byte_mapping_and_catches_the_other(monkeypatch):
    cpu = torch.device("cpu")
    assert fp4.sr_mismatches(sr_standin([0, 1, 2, 3], monkeypatch), cpu) == []
    bad = fp4.sr_mismatches(sr_standin([3, 2, 1, 0], monkeypatch), cpu)
    assert bad and "codes" in bad[0], bad


# --- the mechanism -----------------------------------------------------------------------------

def test_mismatches_compare_bits_with_nan_equal():
    x = torch.tensor([1.0, float("nan"), 0.0])
    assert selfcheck.mismatches(x, x.clone()) == []
    bad = selfcheck.mismatches(torch.tensor([1.0, float("nan"), -0.0]), x)
    assert len(bad) == 1 and "(2,)" in bad[0]


def test_selfcheck_off_uses_paths_unchecked_and_says_so(monkeypatch):
    use_native(monkeypatch, "nibbles")
    monkeypatch.setattr(selfcheck, "ENABLED", False)
    assert fp4.checked_backend("native", torch.device("cpu")) == "native"
    assert any("FP4_SELFCHECK=0" in line for line in selfcheck.LOG)


def test_cli_prints_table_and_writes_check_json(tmp_path):
    env = dict(os.environ, PYTHONPATH=HERE)
    p = subprocess.run([sys.executable, os.path.join(HERE, "check.py")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {ln.split("|")[0].strip(): ln.split("|")[2].strip() for ln in p.stdout.splitlines() if "|" in ln}
    assert rows["mm.emulated"] == rows["mm.bf16"] == rows["quantize.reference"] == "verified"
    assert rows["mm.native"] == rows["kernel.sr"] == "unavailable"
    saved = json.loads((tmp_path / "results" / "cpu" / "check.json").read_text())
    assert saved["command"] == "python check.py" and len(saved["rows"]) == len(rows) - 1
    bad = subprocess.run([sys.executable, os.path.join(HERE, "check.py"), "--bogus"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr and "Traceback" not in bad.stderr


def test_layer_with_a_failing_native_path_trains_on_the_fallback_and_logs_it(monkeypatch):
    """An FP4 linear layer whose default backend is a broken native GEMM: the log sink (train.py's
    log) gets the failure line, and output and gradients are those of the exact backend."""
    def step(layer, x):
        torch.manual_seed(0)  # the backward's random signs and SR seeds
        y = layer(x)
        y.square().sum().backward()
        return y.detach(), x.grad.clone(), layer.weight.grad.clone()

    torch.manual_seed(1)
    layer, x = linear.FP4Linear(256, 128), torch.randn(64, 256)
    want = step(layer, x.clone().requires_grad_())
    lines = []
    selfcheck.attach(lines.append)
    use_native(monkeypatch, "tiles")
    monkeypatch.setattr(fp4, "mm_backend", lambda fmt, device: "native" if fmt == "mxfp4" else "emulated")
    layer.weight.grad = None
    with pytest.warns(RuntimeWarning, match="mm.native"):
        got = step(layer, x.clone().requires_grad_())
    assert any("mm.native on cpu (cpu) FAILED" in ln and "bf16" in ln for ln in lines), lines
    for g, w in zip(got, want):
        assert not selfcheck.mismatches(g, w)


# --- the fused AdamW-NVFP4 kernel: a stand-in that mixes up its two SR seeds ----------------------

def fused_adamw_standin(swap_seeds):
    import optim

    def step(p, st, group, c, seeds):
        s0, s1 = seeds[::-1] if swap_seeds else seeds
        m, v = optim.adamw_nvfp4_reference(p, optim.dequantize_state(st["exp_avg"]), optim.dequantize_state(st["exp_avg_sq"]), c)
        rm, rv = optim._roundings(group)
        st["exp_avg"] = optim.quantize_state(m, "signed", s0, rounding=rm, hadamard=group["hadamard"])
        st["exp_avg_sq"] = optim.quantize_state(v, "sqrt", s1, rounding=rv, hadamard=group["hadamard"], mean=group["mean"])
    return step


def test_fused_adamw_check_catches_a_broken_kernel_and_the_optimizer_falls_back(monkeypatch):
    import optim
    monkeypatch.setattr(optim, "_kernel_device", lambda p: True)  # the CPU plays the GPU
    monkeypatch.setattr(optim, "_adamw_nvfp4_kernel", fused_adamw_standin(False))
    assert optim._check_fused_adamw(torch.device("cpu")) == []
    monkeypatch.setattr(optim, "_adamw_nvfp4_kernel", fused_adamw_standin(True))
    assert optim._check_fused_adamw(torch.device("cpu"))
    ps = [torch.nn.Parameter(torch.linspace(-1, 1, 33 * 128).view(33, 128)) for _ in range(2)]
    for p, fused in zip(ps, (None, False)):  # the default (checked) and the twin
        p.grad = torch.linspace(0.5, -0.3, 33 * 128).view(33, 128)
        with pytest.warns(RuntimeWarning, match="kernel.adamw_nvfp4 on cpu") if fused is None else contextlib.nullcontext():
            optim.AdamW([p], state="nvfp4", hadamard=128, mean="block", seed=3, fused=fused).step()
    assert "kernel.adamw_nvfp4 on cpu" in selfcheck.summary()["fallbacks"]
    assert not selfcheck.mismatches(ps[0].detach(), ps[1].detach())


# --- the Triton attention kernels: a stand-in that forgets the causal mask ------------------------

def triton_standins(monkeypatch, causal_ok):
    import attention as A

    def forward(qq, kq, vq, causal, scale, dtype, **kw):
        o, lse = A.reference_forward(qq, kq, vq, causal and causal_ok, scale)
        return o.to(dtype), lse

    def backward(do, o, lse, qq, kq, vq, causal, scale, seed, ds_rounding, **kw):
        grads = A.reference_backward(do, o, lse, qq, kq, vq, causal, scale, int(seed.item()), ds_rounding)
        return tuple(g.to(o.dtype) for g in grads)
    monkeypatch.setattr(A, "triton_forward", forward)
    monkeypatch.setattr(A, "triton_backward", backward)
    monkeypatch.setattr(A, "_triton_here", lambda device: True)  # the CPU plays the GPU
    return A


def test_triton_attention_check_catches_a_missing_mask_and_falls_back(monkeypatch):
    A = triton_standins(monkeypatch, causal_ok=True)
    assert A._check_triton(torch.device("cpu")) == []
    A = triton_standins(monkeypatch, causal_ok=False)
    assert any(line.startswith("O:") for line in A._check_triton(torch.device("cpu")))
    q, k, v = (torch.randn(1, 2, 64, 32, generator=torch.Generator().manual_seed(i)).bfloat16() for i in range(3))
    with pytest.warns(RuntimeWarning, match="triton.attention on cpu"):
        got = A.attention(q, k, v, fmt="nvfp4")
    monkeypatch.setattr(A, "_triton_here", lambda device: False)
    assert not selfcheck.mismatches(got, A.attention(q, k, v, fmt="nvfp4"))  # the reference's bits


# --- GPU: every path this GPU has passes its check (the H200's paths are bit-exact in the tests) ---

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_available_path_verifies_on_this_gpu():
    import attention, optim  # noqa: E401,F401 (their checks)
    rows = selfcheck.table([torch.device("cuda")])
    bad = [r for r in rows if r["status"] == "fallback"]
    assert not bad, bad
    assert any(r["status"] == "verified" and r["path"].startswith("kernel.") for r in rows) or not fp4.kernels_enabled()


# --- the probes are valid inputs of the paths they check (a refused probe checks nothing) --------

@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("backend", ["bf16", "fp8", "native"])
def test_mm_probes_keep_each_backends_rules(fmt, backend):
    """mm.<backend>'s probe passes the backend's own rules (fp4.mm_refusals: torch._scaled_mm's
    divisibility, the native path's packed K) on every GPU the backend runs on, and still spans more
    than one 128-row scale tile, the padding the native path's swizzle must get right."""
    a, b = formats.mm_probe(fmt)
    for cc in ((8, 9), (9, 0), (10, 0), (12, 0)):
        assert fp4.mm_refusals(backend, a, b, torch.bfloat16, cc) == []
    assert fp4.mm_refusals(backend, a, b, torch.float32, (9, 0)) == []
    assert a.lead_shape[0] > 128 and b.lead_shape[0] % 128


def test_mm_refusals_state_scaled_mm_rules():
    """The rule the old probe broke on the H100 (`mat2 shape (256x72) must be divisible by 16`) and
    the others: refused before any call, by name; the default dispatch takes the exact fallback."""
    a, b = fp4.quantize(torch.randn(64, 256), "mxfp4"), fp4.quantize(torch.randn(72, 256), "mxfp4")
    assert fp4.mm_refusals("fp8", a, b, torch.bfloat16, (9, 0)) == ["N = 72 is not a multiple of 16"]
    assert fp4.mm_refusals("fp8", b, a, torch.bfloat16, (9, 0)) == []  # M: any (mat1's rows)
    assert fp4.mm_refusals("native", b, a, torch.bfloat16, (10, 0)) == ["M = 72 is not a multiple of 16"]
    k48 = [fp4.quantize(torch.randn(64, 96), "mxfp4") for _ in range(2)]
    assert fp4.mm_refusals("native", *k48, torch.bfloat16, (10, 0)) == []
    assert fp4.mm_refusals("fp8", *k48, torch.float32, (8, 9)) == [
        "a torch.float32 output with row-wise scales needs sm_90, not sm_89"]
    with pytest.raises(ValueError, match="mm backend 'fp8' cannot take these operands: N = 72"):
        fp4._mm_fp8(a, b, torch.bfloat16)
    assert fp4.mm_refusals("bf16", a, b, torch.float32) == []


def test_check_availability_by_compute_capability(monkeypatch):
    """What `python check.py` runs on each GPU generation, from stand-in capabilities (no GPU
    here): the BF16 backend and the kernels everywhere (with CuPy), FP8 GEMMs from sm_89, the
    native FP4 GEMM on sm_100 / sm_120 only, the Triton GEMM from sm_80 where Triton is (checked,
    not the default: measured slower); and what mm uses by default there."""
    import attention, gemm, optim  # noqa: E401,F401 (their checks)
    monkeypatch.setattr(fp4.kernels, "enabled", lambda: True)
    monkeypatch.delenv("FP4_BACKEND", raising=False)
    monkeypatch.delenv("FP4_NV_GEMM", raising=False)
    gpu = torch.device("cuda", 0)
    tri = {"mm.triton"} if gemm.triton is not None else set()
    want = {(8, 0): ("bf16", "bf16", {"mm.bf16"} | tri), (8, 9): ("bf16", "bf16", {"mm.bf16", "mm.fp8"} | tri),
            (9, 0): ("fp8", "bf16", {"mm.bf16", "mm.fp8"} | tri),
            (10, 0): ("native", "native", {"mm.bf16", "mm.fp8", "mm.native"} | tri),
            (12, 0): ("native", "native", {"mm.bf16", "mm.fp8", "mm.native"} | tri)}
    for cc, (mx, nv, mms) in want.items():
        monkeypatch.setattr(fp4, "_capability", lambda index, cc=cc: cc)
        here = {p for p, c in selfcheck.CHECKS.items() if c.available(gpu) is None}
        assert {p for p in here if p.startswith("mm.")} == mms | {"mm.emulated"}, cc
        assert {"kernel.quantize", "kernel.rotate_back", "kernel.adamw_nvfp4"} <= here, cc
        assert "quantize.reference" not in here
        assert (fp4.mm_backend("mxfp4", gpu), fp4.mm_backend("nvfp4", gpu)) == (mx, nv), cc
    why = selfcheck.CHECKS["mm.native"].available(gpu)
    assert why is None  # the last stand-in: sm_120
    monkeypatch.setattr(fp4, "_capability", lambda index: (9, 0))
    assert selfcheck.CHECKS["mm.native"].available(gpu) == "not on sm_90"
    monkeypatch.setattr(fp4.kernels, "enabled", lambda: False)
    assert "CuPy" in selfcheck.CHECKS["kernel.quantize"].available(gpu)
