"""Tests of muon.py: Muon and ROOT (the Muon family's optimizers) and build() (AdamW and the FP4
states: test_optim.py; Newton-Schulz itself: test_newton_schulz.py)."""
import io
import math

import pytest
import torch

import muon
import newton_schulz
import optim
from test_optim import gpu


# ---------------------------------------------------------------------------------------------
# Muon and ROOT (Newton-Schulz itself: test_newton_schulz.py)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("kind", ["gauss", "ties", "zeros", "inf_nan", "wide", "signed"])
def test_kth_smallest_is_kthvalue(kind, device):
    """muon.kth_smallest (torch.topk of the smaller side) gives torch.kthvalue's value exactly, on
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
            want, got = x.kthvalue(k).values, muon.kth_smallest(x.to(device), k).cpu()
            assert got.shape == () and (torch.equal(got, want) or (got.isnan() and want.isnan())), (n, k, got, want)
    with pytest.raises(ValueError, match="1 <= k <= numel"):
        muon.kth_smallest(torch.ones(4), 5)
    with pytest.raises(ValueError, match="1-D float32"):
        muon.kth_smallest(torch.ones(4, dtype=torch.float64), 1)


def test_soft_threshold():
    M = torch.randn(40, 50, generator=torch.Generator().manual_seed(5))
    M[3, 7] = 100.0  # an outlier
    B = muon.soft_threshold(M, 0.9)
    eps = M.abs().flatten().sort().values[math.ceil(0.9 * M.numel()) - 1]
    assert B.abs().max() == eps
    assert torch.equal(B, M.clamp(-eps, eps))
    kept = (B == M).float().mean()
    assert 0.9 <= kept <= 0.9 + 1 / M.numel()  # ties aside, exactly the top 10% are clipped
    assert torch.equal(muon.soft_threshold(M, 0.5), M.clamp(-M.abs().median(), M.abs().median()))
    assert muon.soft_threshold(M, None) is M and muon.soft_threshold(M, 1.0) is M


def test_root_step_is_the_formula():
    """Two steps of ROOT on one matrix against SPEC 8.2 written out: EMA momentum, Nesterov,
    soft threshold, NS with the shape's coefficients, weight decay, RMS-matching scale."""
    g = torch.Generator().manual_seed(6)
    w0 = torch.randn(32, 48, generator=g)
    grads = [torch.randn(32, 48, generator=g) for _ in range(2)]
    p = torch.nn.Parameter(w0.clone())
    opt = muon.ROOT([p], lr=0.01, momentum=0.9, weight_decay=0.1, soft_threshold=0.8, ns="fp32")
    w, buf = w0.clone(), torch.zeros_like(w0)
    for grad in grads:
        p.grad = grad.clone()
        opt.step()
        buf = 0.9 * buf + 0.1 * grad
        u = muon.soft_threshold(0.9 * buf + 0.1 * grad, 0.8)
        O = newton_schulz.newton_schulz(u, 5, newton_schulz.MUON_COEFFICIENTS, "fp32")
        w = w * (1 - 0.01 * 0.1) - 0.01 * 0.2 * math.sqrt(48) * O
    torch.testing.assert_close(p.detach(), w, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], buf, atol=1e-7, rtol=1e-6)
    assert muon.update_scale((32, 48), "shape") == 1.0 and muon.update_scale((48, 32), "shape") == math.sqrt(1.5)


def test_root_two_term_momentum():
    """state='nvfp4x2': m ~ Q(m) + Q(m - Q(m)), both rounded to nearest. The second term quantizes
    the first's error r (|r| ~ d |m|, d = one term's relative error) with its own 16-block scales,
    so what is left is ~ d |r| ~ d^2 |m|: with d ~ 0.1 (NVFP4 on Gaussian data) about a tenth of
    one term's error; the bound, a quarter, leaves margin. Twice one term's bytes; a tensor too
    small to quantize stays one FP32 entry. The step uses the sum."""
    g = torch.Generator().manual_seed(7)
    m = torch.randn(256, 512, generator=g) * torch.exp(torch.randn(256, 1, generator=g))  # rows of unlike scale
    one = muon._momentum_state(m, "nvfp4", 3)
    two = muon._momentum_state(m, "nvfp4x2", 3)
    rel = lambda st: float((muon._momentum_value(st) - m).norm() / m.norm())  # noqa: E731
    print(f"relative error: one term {rel(one):.4f}, two terms {rel(two):.4f}")
    assert 0.05 < rel(one) < 0.2 and rel(two) < 0.25 * rel(one)
    assert set(two) == {"momentum_buffer", "momentum_residual"} and all(optim.is_packed(v) for v in two.values())
    assert optim.state_nbytes(two["momentum_buffer"]) == optim.state_nbytes(one["momentum_buffer"]) == m.numel() * 9 // 16 + 4
    small = muon._momentum_state(torch.ones(8, 24), "nvfp4x2", 0)
    assert set(small) == {"momentum_buffer"} and torch.equal(small["momentum_buffer"], torch.ones(8, 24))
    p = torch.nn.Parameter(torch.zeros(64, 128))
    opt = muon.ROOT([p], lr=0.01, ns="fp32", state="nvfp4x2", soft_threshold=None)
    p.grad = m[:64, :128].clone()
    opt.step()  # from zero momentum: m = 0.05 g held in two terms, the update from 0.95 m + 0.05 g
    held = muon._momentum_value(opt.state[p])
    assert float((held - 0.05 * p.grad).norm() / (0.05 * p.grad).norm()) < 0.25 * rel(one)
    assert optim.state_bytes(opt) == 2 * (64 * 128 * 9 // 16 + 4)


def test_root_bad_input():
    with pytest.raises(ValueError, match="1-D parameter of shape"):
        muon.ROOT([torch.nn.Parameter(torch.zeros(8))])
    with pytest.raises(ValueError, match="3-D parameter of shape"):
        muon.ROOT([torch.nn.Parameter(torch.zeros(2, 8, 8))])
    with pytest.raises(ValueError, match="divisible by 16"):
        muon.ROOT([torch.nn.Parameter(torch.zeros(24, 32))], ns="nvfp4")
    p = [torch.nn.Parameter(torch.zeros(16, 16))]
    for bad, match in [(dict(ns="fp8"), "ns must be"), (dict(state="int8"), "state must be"),
                       (dict(soft_threshold=1.5), "soft_threshold"), (dict(momentum=1.0), "momentum"),
                       (dict(coefficients="x"), "coefficients"), (dict(scale="spectral"), "scale rule"),
                       (dict(ns_design="cast"), "ns_design"), (dict(lr=-1.0), "lr")]:
        with pytest.raises(ValueError, match=match):
            muon.ROOT(p, **bad)
    with pytest.raises(ValueError, match="2-D tensor"):
        newton_schulz.newton_schulz(torch.zeros(4, 4, 4))
    with pytest.raises(ValueError, match="precision"):
        newton_schulz.newton_schulz(torch.zeros(16, 16), precision="fp16")
    with pytest.raises(TypeError, match="floating-point"):
        newton_schulz.newton_schulz(torch.zeros(16, 16, dtype=torch.int32))
    G = torch.randn(16, 32)
    G[0, 0] = float("nan")
    assert newton_schulz.newton_schulz(G, precision="nvfp4").isnan().any()  # NaN propagates
    for precision in newton_schulz.NS_PRECISIONS:  # a zero gradient gives a zero update, not NaN
        assert torch.equal(newton_schulz.newton_schulz(torch.zeros(16, 32), precision=precision), torch.zeros(16, 32))


# ---------------------------------------------------------------------------------------------
# build(): which parameters each optimizer gets, resuming, train.py --optimizer


def tiny_model():
    import model
    torch.manual_seed(0)
    return model.GPT(model.config_for("tiny", vocab_size=256, block_size=32))


def test_build_routes_parameters():
    m = tiny_model()
    opt = muon.build(m, "root", lr=1e-3, weight_decay=0.1)
    root, adamw = opt.parts
    assert isinstance(root, muon.ROOT) and isinstance(adamw, torch.optim.AdamW)
    on_root = {id(p) for g in root.param_groups for p in g["params"]}
    names = {id(p): n for n, p in m.named_parameters()}
    assert all(names[i].startswith("transformer.h.") and names[i].endswith("weight") for i in on_root)
    assert len(on_root) == 4 * 3  # qkv, o, gate_up, down in each of 3 blocks
    on_adamw = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert {"transformer.wte.weight", "lm_head.weight", "transformer.ln_f.weight"} <= on_adamw
    assert len(on_root) + len(on_adamw) == len(list(m.parameters()))
    for g in opt.param_groups:  # how train.py sets the schedule
        g["lr"] = 0.5
    assert all(g["lr"] == 0.5 for o in opt.parts for g in o.param_groups)
    assert isinstance(muon.build(m, "adamw"), torch.optim.AdamW)
    assert muon.build(m, "muon").parts[0].defaults["coefficients"] == "muon"
    fp4_root = muon.build(m, "root_fp4").parts[0].defaults
    assert fp4_root["ns"] == "nvfp4" and fp4_root["state"] == "bf16"
    with pytest.raises(ValueError, match="unknown optimizer"):
        muon.build(m, "sgd")


def train_steps(m, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 256, (4, 33), generator=g)
        _, loss = m(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name,before,states", [("root", 2, None), ("root_fp4", 1, None), ("root_fp4", 1, "nvfp4x2")])
def test_state_dict_resume_is_exact(name, before, states):
    """Stop after `before` steps, save model + optimizer, resume in fresh objects: the next 2 steps
    repeat the uninterrupted run's losses exactly (float equality), nvfp4 Newton-Schulz included;
    the momentum keeps its format (BF16, two NVFP4 terms) through the load."""
    m = tiny_model()
    opt = muon.build(m, name, lr=3e-3, states=states)
    train_steps(m, opt, before, seed=0)
    buf = io.BytesIO()
    torch.save(dict(model=m.state_dict(), opt=opt.state_dict()), buf)
    held = lambda o: sorted((n, str(v.dtype) if isinstance(v, torch.Tensor) else 'packed')  # noqa: E731
                            for st in o.parts[0].state.values() for n, v in st.items() if n.startswith("momentum"))
    before_load, bytes_before = held(opt), optim.state_bytes(opt)
    want = train_steps(m, opt, 2, seed=1)
    buf.seek(0)
    ck = torch.load(buf, weights_only=False)
    m2 = tiny_model()
    m2.load_state_dict(ck["model"])
    opt2 = muon.build(m2, name, lr=3e-3, states=states)
    opt2.load_state_dict(ck["opt"])
    assert held(opt2) == before_load and optim.state_bytes(opt2) == bytes_before
    assert train_steps(m2, opt2, 2, seed=1) == want
    with pytest.raises(ValueError, match="optimizer state is for"):
        muon.build(m2, "torch_muon").load_state_dict(ck["opt"])  # Muon + AdamW, not ROOT + AdamW


def test_train_py_optimizer(tmp_path):
    """train.py --optimizer=root builds through muon.build, logs and records it; a bad name is a
    config error naming the choices."""
    import test_train
    test_train.write_corpus(str(tmp_path), n=4000)
    s = test_train.run(str(tmp_path), tmp_path / "out", "--recipe=bf16", "--optimizer=root",
                       "--max_iters=3", "--eval_interval=3")
    assert s["optimizer"] == "root" and len(s["loss_curve"]["train_loss"]) == 3
    assert "optimizer root" in (tmp_path / "out" / "train.log").read_text()
    with pytest.raises(Exception, match="optimizer='sgd': must be one of 'adamw'"):
        test_train.run(str(tmp_path), tmp_path / "bad", "--optimizer=sgd", "--max_iters=1")


def test_build_ablation_overrides():
    """muon.build's ns and states replace one part of a preset (train.py --ns_precision,
    --optimizer_states: the fullstack ablation); a combination that cannot apply is refused."""
    net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))  # 2-D weights + biases
    def parts(opt):
        root = [g for g in opt.param_groups if "ns" in g]
        adam = [o for o in opt.parts if not isinstance(o, muon.ROOT)][0]
        return {(g["ns"], g["state"]) for g in root}, (type(adam).__name__, adam.param_groups[0].get("state"))
    assert parts(muon.build(net, "root_fp4")) == ({("nvfp4", "bf16")}, ("AdamW", "nvfp4"))
    assert parts(muon.build(net, "root_fp4", ns="bf16")) == ({("bf16", "bf16")}, ("AdamW", "nvfp4"))
    assert parts(muon.build(net, "root_fp4", states="nvfp4x2")) == ({("nvfp4", "nvfp4x2")}, ("AdamW", "nvfp4"))
    assert parts(muon.build(net, "root", states="nvfp4")) == ({("bf16", "nvfp4")}, ("AdamW", "nvfp4"))
    got = parts(muon.build(net, "root_fp4", states="fp32"))
    assert got[0] == {("nvfp4", "fp32")} and got[1][1] is None  # torch's AdamW: no 'state' key
    assert isinstance(muon.build(net, "adamw", states="nvfp4"), optim.AdamW)
    for name, kw in [("adamw", dict(ns="bf16")), ("torch_muon", dict(states="fp32")), ("root", dict(ns="fp8")),
                     ("root", dict(states="int8")), ("adamw", dict(states="bf16")), ("adamw_fp4", dict(states="nvfp4x2"))]:
        with pytest.raises(ValueError, match="ns=|states="):
            muon.build(net, name, **kw)
