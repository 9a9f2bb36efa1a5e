"""GEMM backends, FP4Linear and the recipes (CPU; the CUDA backends skip without a GPU)."""
import math

import pytest
import torch

import fp4

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


# --- mm -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_mm_emulated_is_the_dequantized_product(fmt):
    a = fp4.quantize(torch.randn(48, 256), fmt)
    b = fp4.quantize(torch.randn(256, 80), fmt, axis=0)  # (K, N) quantized along K
    y = fp4.mm(a, b, torch.float32, backend="emulated")
    assert torch.equal(y, fp4.dequantize(a) @ fp4.dequantize(b))


def test_mm_bad_input():
    a, b = fp4.quantize(torch.randn(8, 64)), fp4.quantize(torch.randn(8, 96))
    with pytest.raises(ValueError, match="quantized along K"):
        fp4.mm(a, b)
    with pytest.raises(ValueError, match="share a format"):
        fp4.mm(a, fp4.quantize(torch.randn(8, 64), "nvfp4"))
    with pytest.raises(TypeError, match="two QTensors"):
        fp4.mm(a, torch.randn(8, 64))
    with pytest.raises(ValueError, match="unknown mm backend 'int4'"):
        fp4.mm(a, a, backend="int4")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        fp4.mm(a, a, backend="fp8")


def test_backend_choice(monkeypatch):
    assert fp4.mm_backend("mxfp4", "cpu") == "emulated"
    monkeypatch.setenv("FP4_BACKEND", "bf16")
    assert fp4.mm_backend("mxfp4", "cpu") == "bf16"
    monkeypatch.setenv("FP4_BACKEND", "tf32")
    with pytest.raises(ValueError, match="FP4_BACKEND='tf32'"):
        fp4.mm_backend("mxfp4", "cpu")
    monkeypatch.delenv("FP4_BACKEND")
    b = fp4.backends("cpu")
    assert b["quantize"] == "torch" and b["mm"] == "emulated"


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_native_layout_preparation(fmt):
    """The Blackwell operands, built on the CPU: FP4 views of the codes, B column-major, scales
    swizzled into cuBLAS's 128x4 tiles (they unswizzle back to the QTensor's scales)."""
    a = fp4.quantize(torch.randn(200, 320), fmt)
    b = fp4.quantize(torch.randn(72, 320), fmt)
    args = fp4.native_args(a, b)
    assert args["mat_a"].dtype == torch.float4_e2m1fn_x2 and args["mat_a"].shape == (200, 160)
    assert args["mat_b"].shape == (160, 72) and args["mat_b"].stride() == (1, 160)  # column-major
    sdt = torch.float8_e8m0fnu if fmt == "mxfp4" else torch.float8_e4m3fn
    assert args["scale_a"].dtype == sdt
    bs = fp4.FORMATS[fmt]
    assert args["scale_a"].numel() == 256 * (-(-(320 // bs) // 4) * 4)
    back = fp4.unswizzle_scales(args["scale_a"].view(torch.uint8), 200, 320 // bs)
    assert torch.equal(back, a.scales)
    assert torch.equal(args["mat_a"].view(torch.uint8), a.codes)


@cuda
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("shape", [(128, 256, 96), (512, 2048, 384), (64, 4096, 128)])
def test_cuda_backends_match_emulated(fmt, shape):
    m, k, n = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g)
    w = torch.randn(n, k, device="cuda", generator=g)
    a, b = fp4.quantize(x, fmt, hadamard=32), fp4.quantize(w, fmt, hadamard=32)
    want = fp4.mm(a, b, torch.float32, backend="emulated")
    backends = ["bf16"] + (["fp8"] if fmt == "mxfp4" and torch.cuda.get_device_capability() == (9, 0) else [])
    for backend in backends:
        got = fp4.mm(a, b, torch.float32, backend=backend)
        # exact products, FP32 accumulation in another order: |err| <= K * 2^-23 * sum|a||b|,
        # which for rotated Gaussian operands is far below 1e-5 of the norm
        assert rel(got, want) < 1e-5, (backend, rel(got, want))


@cuda
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0), reason="Hopper only")
def test_fp8_fast_accumulation_bound():
    """Inside the bound K * 144 * 2^(span_a + span_b) <= 2^FAST_ACCUM_BITS the fast mode is
    exact: the FP32 result equals the FP64 product of the dequantized operands."""
    bits = fp4.FAST_ACCUM_BITS
    if bits <= 0:
        pytest.skip("fast accumulation disabled (FP4_FAST_ACCUM_BITS=0)")
    k = 2 ** (bits - 8) // 144 * 32 // 32 * 32 or 32
    x = torch.randn(256, k, device="cuda")
    a = fp4.quantize(x.clamp(-1, 1) + torch.sign(x) * 4)  # span 0: one scale everywhere
    assert fp4.fast_accum_ok(a, a)
    want = fp4.dequantize(a).double() @ fp4.dequantize(a).double().t()
    got = fp4.mm(a, a, torch.float32, backend="fp8")
    assert torch.equal(got.double(), want), rel(got, want)


# --- FP4Linear ----------------------------------------------------------------------------------

def test_bf16_recipe_equals_nn_linear():
    torch.manual_seed(0)
    ref = torch.nn.Linear(64, 32, bias=True)
    lin = fp4.FP4Linear(64, 32, bias=True, recipe="bf16")
    lin.load_state_dict(ref.state_dict())
    x = torch.randn(5, 64)
    assert torch.equal(lin(x), ref(x))


def test_quartet_forward_is_reference_path():
    torch.manual_seed(1)
    lin = fp4.FP4Linear(256, 128, recipe="quartet")
    x = torch.randn(64, 256)
    qx = fp4.quantize(x, "mxfp4", scale_rule="quest", hadamard=32)
    qw = fp4.quantize(lin.weight, "mxfp4", scale_rule="quest", hadamard=32)
    assert torch.equal(lin(x), fp4.mm(qx, qw, torch.float32))


def _ste_grads(recipe, x, w, e):
    """The straight-through gradients of the quantized forward (what the FP4 backward estimates)."""
    r = fp4.RECIPES[recipe]
    qx, qw = fp4.quantize(x, r["fmt"], **r["x"]), fp4.quantize(w, r["fmt"], **r["w"])
    dx, dw = e @ fp4.dequantize(qw), e.t() @ fp4.dequantize(qx)
    if r["rotate_back"]:
        dx = fp4.hadamard(dx * qx.clip_mask(), 32)
        dw = fp4.hadamard(dw * qw.clip_mask(), 32)
    return dx, dw


@pytest.mark.parametrize("recipe", ["quartet", "nvfp4", "quartet2"])
def test_backward_unbiased_and_really_fp4(recipe):
    """Averaged over n backward calls (1, 8, 128) (fresh seeds and signs each), the gradient converges to the
    straight-through gradient of the quantized forward like 1/sqrt(n); one call is FP4-noisy."""
    torch.manual_seed(2)
    m, k, n = 128, 128, 128
    x, w, e = torch.randn(m, k), torch.randn(n, k) * 0.05, torch.randn(m, n)
    out = fp4._linear_fwd(x, w, recipe, torch.float32)
    ste_dx, ste_dw = _ste_grads(recipe, x, w, e)
    sums, errs = [torch.zeros_like(x), torch.zeros_like(w)], {}
    for i in range(1, 129):
        dx, dw = fp4._linear_bwd(e, *out[1:], recipe, torch.float32, torch.float32)
        sums[0] += dx
        sums[1] += dw
        if i in (1, 8, 128):
            errs[i] = (rel(sums[0] / i, ste_dx), rel(sums[1] / i, ste_dw))
    for j, name in enumerate(("dX", "dW")):
        e1, e8, e128 = errs[1][j], errs[8][j], errs[128][j]
        assert 0.02 < e1 < 0.6, f"{name}: one call is not FP4-sized noise ({e1})"
        # quartet is unbiased by construction (SR, no clipping under absmax). nvfp4 rounds X to
        # nearest in wgrad, and its E4M3 block scales are rounded to nearest, so an amax that lands
        # above 6 saturates (a small bias); quartet2's MS-EDEN is unbiased only over rotations.
        biased = recipe != "quartet"
        if not biased:  # 1/sqrt(n): 16x the calls, 1/4 of the error (0.25; allow 0.18..0.35)
            assert 0.18 < e128 / e8 < 0.35, f"{name}: error {e8} -> {e128} is not 1/sqrt(n)"
        else:  # still converging, to a small bias
            assert e128 < 0.5 * e8 and e128 < 0.05, (name, e8, e128)


@pytest.mark.parametrize("recipe", ["quartet", "nvfp4", "quartet2"])
def test_three_gemms_get_qtensors(recipe, monkeypatch):
    calls = []
    real_mm = fp4.mm

    def counting_mm(a, b, *args, **kw):
        calls.append((type(a).__name__, type(b).__name__, a.fmt))
        return real_mm(a, b, *args, **kw)

    monkeypatch.setattr(fp4, "mm", counting_mm)
    lin = fp4.FP4Linear(128, 128, recipe=recipe)
    x = torch.randn(2, 64, 128, requires_grad=True)
    lin(x).sum().backward()
    fmt = fp4.RECIPES[recipe]["fmt"]
    assert calls == [("QTensor", "QTensor", fmt)] * 3
    assert x.grad.shape == x.shape and lin.weight.grad.shape == lin.weight.shape


@pytest.mark.parametrize("recipe, ratio", [("quartet", 3.0), ("nvfp4", 3.4), ("quartet2", 3.4)])
def test_saved_activations_are_fp4(recipe, ratio):
    """The forward saves FP4 codes + scales (+ QuEST's 1-bit mask), not a 2-byte copy of X."""
    lin = fp4.FP4Linear(256, 256, recipe=recipe, dtype=torch.bfloat16)
    x = torch.randn(512, 256, dtype=torch.bfloat16, requires_grad=True)
    saved = []

    def pack_hook(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        lin(x)
    x_bytes = x.numel() * 2
    # X and W are the same size here: their FP4 copies together vs the BF16 X alone times 2
    assert 2 * x_bytes / sum(saved) > ratio, (sum(saved), x_bytes)


def test_to_fp4_swaps_in_place_and_skips():
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128))
    w0 = model[0].weight
    fp4.to_fp4(model, "quartet", skip=["2"])
    assert isinstance(model[0], fp4.FP4Linear) and model[0].weight is w0 and model[0].recipe == "quartet"
    assert type(model[2]) is torch.nn.Linear
    fp4.to_fp4(model, "nvfp4", skip=lambda name, mod: False)
    assert isinstance(model[2], fp4.FP4Linear) and model[0].recipe == "quartet"  # already swapped
    model(torch.randn(32, 128)).sum().backward()


def test_linear_bad_input():
    with pytest.raises(ValueError, match="unknown recipe 'fp2'"):
        fp4.FP4Linear(128, 128, recipe="fp2")
    with pytest.raises(ValueError, match="divisible by 128"):
        fp4.FP4Linear(128, 96, recipe="quartet2")
    with pytest.raises(ValueError, match="token count"):
        fp4.FP4Linear(64, 64, recipe="quartet")(torch.randn(5, 64))
    with pytest.raises(ValueError, match="unknown recipe"):
        fp4.to_fp4(torch.nn.Linear(4, 4), "int8")


def test_compile_has_no_graph_breaks():
    torch._dynamo.reset()
    model = torch.nn.Sequential(fp4.FP4Linear(128, 256), torch.nn.GELU(), fp4.FP4Linear(256, 128))
    x = torch.randn(64, 128)
    explain = torch._dynamo.explain(model)(x)
    assert explain.graph_break_count == 0, explain.break_reasons
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    torch.manual_seed(3)
    y = compiled(x)
    y.square().sum().backward()
    assert model[0].weight.grad is not None and torch.isfinite(model[0].weight.grad).all()
    assert torch.equal(y, model(x))  # the forward is deterministic (RN)
