"""The numerics measurements behind the design choices: python study/measure.py --sections ns,ns_uneven,states,root_states,lora_rank

SPEC's "decide by measurement": each section measures the candidate designs of one numeric choice,
on a CPU, or on a GPU where there is one:

$ python study/measure.py --sections ns --ns-sizes 30m --momentum out/mom30m_muon/ckpt.pt   # Newton-Schulz designs
$ python study/measure.py --sections ns_uneven --ns-sizes 30m --momentum out/mom30m_muon/ckpt.pt   # uneven rows/columns
$ python study/measure.py --sections states --states-lm 300    # the NVFP4 optimizer-state format (optim.py)
$ python study/measure.py --sections root_states --root-lm 300  # the format of ROOT's momentum (muon.ROOT_STATES)
$ python study/measure.py --sections lora_rank --ckpt out/ckpt.pt --backward   # the fullstack recipe's rank
$ python study/measure.py --sections lora_rank --device=cuda --synthetic=2048x2048 --ranks=32,128 --calls=2  # a GPU check

ns: Newton-Schulz in FP4 (newton_schulz.py, SPEC 8.2), the cosine to the exact polar factor per design, at
every 2-D block shape of --ns-sizes (its GPU time per optimizer step is bench.py --sections ns_time).
ns_uneven: the same on inputs whose row or column norms spread up to 1000:1, and on momentum.
states: candidate NVFP4 formats of AdamW's m and v (SPEC 8.1), single-shot and EMA errors and a
regression's loss. root_states: ROOT's momentum held in FP32, BF16, one or two NVFP4 terms, its
recursion replayed on a synthetic gradient stream (and the tiny LM trained). lora_rank: how much the BF16 rank-r part (LoRA-SVD, SPEC 8.4) cuts a linear
layer's FP4 error, by rank. Each section returns rows (dicts), printed as they come; they are
written with the run's meta (bench_io.run_meta, the option values under "args") to
results/<gpu-name-slug>/ (--out: another folder, or with one section a .json file name) as
bench_ns.json, bench_states.json, measure_root_states.json and lora_rank.json.
"""
import argparse
import math
import os
import sys
import time
from contextlib import contextmanager

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as `python study/measure.py`

import bench_io  # noqa: E402
import fp4  # noqa: E402
import linear  # noqa: E402
from bench_io import print_table, print_table_row  # noqa: E402
from bench_ops import FP4_SPEEDUP, ns_shapes  # noqa: E402

# ---------------------------------------------------------------------------------------------
# states: the NVFP4 optimizer-state format, decided by measurement (SPEC 8.1; runs on a CPU)

# (hadamard, mean of sqrt(v), rounding (m, v)) candidates; the first is optim's default
STATE_FORMATS = [(0, "none", ("sr", "rn")), (0, "none", ("rn", "rn")), (0, "none", ("sr", "sr")), (0, "block", ("sr", "rn")),
                 (16, "block", ("sr", "rn")), (128, "block", ("sr", "sr")), (128, "block", ("rn", "rn")),
                 (128, "none", ("sr", "sr"))]


def _heavy_moments(shape=(256, 512), steps=50, seed=0):
    """Exact AdamW m, v after Student-t(2) gradients whose rows span orders of magnitude."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.exp(2.0 * torch.randn(shape[0], 1, generator=gen))
    m, v = torch.zeros(shape), torch.zeros(shape)
    for _ in range(steps):
        g = torch.randn(shape, generator=gen) / torch.sqrt(torch.rand(shape, generator=gen).log().neg()) * rows * 1e-4
        m.lerp_(g, 0.1)
        v.mul_(0.95).addcmul_(g, g, value=0.05)
    return [("heavy-tailed", m, v)]


def _lm_batches(vocab=2048, batch=16, seq=64):
    """data/pycode tokens mapped to their `vocab` - 1 most frequent ids (+ one for the rest): real
    text statistics at a CPU-sized lm_head; None when the corpus is not prepared."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "pycode")
    if not os.path.exists(os.path.join(path, "train.bin")):
        return None
    data = {s: np.asarray(np.memmap(os.path.join(path, f"{s}.bin"), dtype=np.uint32, mode="r")[:2_000_000])
            for s in ("train", "val")}
    ids, counts = np.unique(data["train"], return_counts=True)
    remap = np.full(int(max(d.max() for d in data.values())) + 1, vocab - 1, dtype=np.int64)
    remap[ids[np.argsort(-counts)][: vocab - 1]] = np.arange(vocab - 1)
    data = {s: remap[d] for s, d in data.items()}

    def get(split, key, b=batch):
        ix = np.random.default_rng(key).integers(0, len(data[split]) - seq - 1, size=b)
        x = torch.from_numpy(np.stack([data[split][i:i + seq + 1] for i in ix]))
        return x[:, :-1], x[:, 1:]
    return get


def _tiny_lm_run(get, steps, seed, lr, make_opt=None, **opt_kw):
    """The tiny Llama (vocab 2048) trained `steps` steps; returns the model, its optimizer (AdamW
    with opt_kw, or make_opt(net)) and the val loss."""
    import model as llama
    import optim
    torch.manual_seed(seed)
    net = llama.GPT(llama.config_for("tiny", vocab_size=2048, block_size=64))
    groups = [dict(params=[p for p in net.parameters() if p.dim() >= 2]),
              dict(params=[p for p in net.parameters() if p.dim() < 2], weight_decay=0.0)]
    opt = make_opt(net) if make_opt else optim.AdamW(groups, lr=lr, seed=seed, **opt_kw)
    warm = steps // 10
    for it in range(steps):
        frac = (it - warm) / (steps - warm)
        for g in opt.param_groups:
            g["lr"] = lr * (it + 1) / (warm + 1) if it < warm else lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        _, loss = net(*get("train", [seed, it]))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        val = sum(net(*get("val", [99, k], 32))[1].item() for k in range(16)) / 16
    return net, opt, val


def _format_errors(sets, fmt):
    """One quantization of each (m, v): relative MSE of v, the share of v > 0 rebuilt as 0, and the
    relative MSE of the update m / (sqrt(v) + eps) from both rebuilt states (ratio clamp applied)."""
    import optim
    h, mean, (rm, rv) = fmt
    c = optim.ratio_bound((0.9, 0.95), 1000)
    acc = dict(v=0.0, vd=0.0, z=0.0, n=0.0, u=0.0, ud=0.0)
    for _, m, v in sets:
        mh = optim.dequantize_state(optim.quantize_state(m, "signed", rounding=rm, hadamard=h)).double()
        vh = optim.dequantize_state(optim.quantize_state(v, "sqrt", rounding=rv, hadamard=h, mean=mean)).double()
        m, v = m.double(), v.double()
        u, sh = m / (v.sqrt() + 1e-8), vh.sqrt()
        uh = torch.where(mh.abs() > c * sh, c * sh * mh.sign(), mh) / (sh + 1e-8)
        for k, val in (("v", ((vh - v) ** 2).sum()), ("vd", (v ** 2).sum()), ("z", ((v > 0) & (vh <= 0)).sum()),
                       ("n", (v > 0).sum()), ("u", ((uh - u) ** 2).sum()), ("ud", (u ** 2).sum())):
            acc[k] += float(val)
    return dict(v_rel_mse=acc["v"] / acc["vd"], v_zeroed=acc["z"] / acc["n"], update_rel_mse=acc["u"] / acc["ud"])


def _v_direct_errors(sets):
    """NVFP4 of v itself (no square root), the baseline of SPEC 8.1's 60% claim."""
    num = den = z = n = 0.0
    for _, _, v in sets:
        vh = fp4.dequantize(fp4.quantize(v.reshape(-1, v.shape[-1]), "nvfp4")).clamp(min=0).view(v.shape).double()
        num, den = num + float(((vh - v.double()) ** 2).sum()), den + float((v.double() ** 2).sum())
        z, n = z + float(((v > 0) & (vh <= 0)).sum()), n + float((v > 0).sum())
    return dict(v_rel_mse=num / den, v_zeroed=z / n)


def _ema_off(kind, fmt, steps=60, tail=20):
    """Share of elements whose EMA, re-quantized every step, averages > 20% off the exact EMA's over
    the last `tail` steps: m through a sign flip (from -target), v decaying from 4 target."""
    import optim
    h, mean, (rm, rv) = fmt
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(64, 256, generator=gen) * torch.exp(torch.randn(64, 1, generator=gen))
    b, start, kw = (0.9, -1.0, dict(rounding=rm, hadamard=h)) if kind == "signed" else \
        (0.95, 4.0, dict(rounding=rv, hadamard=h, mean=mean))
    target = target if kind == "signed" else target * target
    exact = start * target
    s, avg = optim.quantize_state(exact, kind, seed=0, **kw), torch.zeros_like(exact, dtype=torch.float64)
    for t in range(steps):
        exact = b * exact + (1 - b) * target
        s = optim.quantize_state(b * optim.dequantize_state(s) + (1 - b) * target, kind, seed=t + 1, **kw)
        if t >= steps - tail:
            avg += optim.dequantize_state(s).double() / tail
    return float(((avg - exact.double()).abs() > 0.2 * exact.double().abs()).float().mean())


def regression_loss(seed, steps=300, lr=3e-2, **opt_kw):
    """Least squares, inputs with log-normal channel scales (LLM activations' outlier channels):
    the final full-batch loss (noise floor 1e-4). test_optim.py tests it too."""
    import optim
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4096, 256, generator=gen) * torch.exp(torch.randn(1, 256, generator=gen))
    y = x @ (torch.randn(64, 256, generator=gen) / 16).t() + 0.01 * torch.randn(4096, 64, generator=gen)
    w, bias = torch.nn.Parameter(torch.zeros(64, 256)), torch.nn.Parameter(torch.zeros(64))
    opt = optim.AdamW([w, bias], lr=lr, weight_decay=0.0, **opt_kw)
    for it in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * it / steps))
        idx = torch.randint(0, 4096, (256,), generator=gen)
        ((x[idx] @ w.t() + bias - y[idx]) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        return float(((x @ w.t() + bias - y) ** 2).mean())


def section_states(args):
    """Rows per candidate format: single-shot errors on heavy-tailed and real (tiny LM) moments,
    EMA drift, a regression's final loss against FP32 AdamW's, and (--states-lm) the tiny LM's
    val loss: what optim's defaults (STATE_HADAMARD, STATE_MEAN, STATE_ROUNDING) were chosen by."""
    get = _lm_batches()
    sets = {"heavy-tailed": _heavy_moments()}
    if get is None:
        print("  data/pycode not prepared: no tiny-LM moments (python data/pycode/prepare.py)")
    else:  # FP32 AdamW's moments after 200 steps of the tiny LM on real text
        _, opt, _ = _tiny_lm_run(get, 200, 0, 3e-3, state="fp32")
        sets["tiny LM"] = [(None, st["exp_avg"], st["exp_avg_sq"]) for p, st in opt.state.items() if p.dim() == 2]
    fp32_reg = [regression_loss(s) for s in range(3)]
    lm_fp32 = [_tiny_lm_run(get, args.states_lm, s, 1.5e-3, state="fp32")[2] for s in (0, 1)] if get and args.states_lm else None
    rows = [dict(format=f"v direct (NVFP4 of v), data {name}", **_v_direct_errors(s)) for name, s in sets.items()]
    for fmt in STATE_FORMATS:
        h, mean, rnd = fmt
        row = dict(format=f"H{h} mean {mean} m {rnd[0]} v {rnd[1]}")
        for name, s in sets.items():
            row.update({f"{k} ({name})": val for k, val in _format_errors(s, fmt).items()})
        row.update(m_flip_off=_ema_off("signed", fmt), v_decay_off=_ema_off("sqrt", fmt))
        reg = [regression_loss(s, state="nvfp4", hadamard=h, mean=mean, rounding=rnd) for s in range(3)]
        row["regression_vs_fp32"] = math.exp(sum(math.log(a / b) for a, b in zip(reg, fp32_reg)) / 3)
        if lm_fp32:
            lm = [_tiny_lm_run(get, args.states_lm, s, 1.5e-3, state="nvfp4", hadamard=h, mean=mean, rounding=rnd)[2]
                  for s in (0, 1)]
            row.update(lm_val=[round(v, 4) for v in lm], lm_val_fp32=[round(v, 4) for v in lm_fp32])
        rows.append(row)
        print(f"  {row['format']}: done")
    print_table(rows, list(dict.fromkeys(k for r in rows for k in r)))
    print(f"regression, FP32 AdamW: {[f'{v:.4e}' for v in fp32_reg]}")
    return rows


# ---------------------------------------------------------------------------------------------
# root_states: the format of ROOT's momentum (muon.ROOT_STATES), decided by measurement

ROOT_STATE_COLS = ("shape", "noise", "optimizer", "state", "ns", "update_cos", "momentum_rel_err", "lm_val")
ROOT_STATE_ROWS = [("fp32", "bf16"), ("bf16", "bf16"), ("nvfp4", "bf16"), ("nvfp4x2", "bf16"), ("fp32", "nvfp4"),
                   ("nvfp4x2", "nvfp4")]


def _cos(a, b):
    return float((a * b).sum() / (a.norm() * b.norm()))


def momentum_replay(shape, noise, steps, seed=0, beta=0.95):
    """ROOT's momentum recursion (EMA beta, Nesterov, soft threshold, ROOT's coefficients) on a
    synthetic gradient stream g_t = S + noise * N_t / sqrt(numel): S a fixed power-law matrix
    (i^-1, unit Frobenius norm), N_t fresh Gaussian. Per (state, ns) of ROOT_STATE_ROWS: the mean
    over the second half of the steps of the update's cosine to the update of FP32 momentum with
    BF16 Newton-Schulz, and of the momentum's relative error."""
    import muon
    import newton_schulz
    gen = torch.Generator().manual_seed(seed)
    S = power_law_matrix(shape, 1.0, seed).float()
    S = S / S.norm()
    abc = newton_schulz.ns_coefficients(shape, "root")

    def update(buf, g, ns):  # ROOT._update from the step's FP32 momentum on
        return newton_schulz.newton_schulz(muon.soft_threshold(g.lerp(buf, beta), 0.9), 5, abc, ns)

    exact = torch.zeros(shape)
    held = {row: muon._momentum_state(torch.zeros(shape), row[0], 0) for row in ROOT_STATE_ROWS}
    cos, err = {row: [] for row in ROOT_STATE_ROWS}, {row: [] for row in ROOT_STATE_ROWS}
    for t in range(steps):
        g = S + noise * torch.randn(shape, generator=gen) / math.sqrt(S.numel())
        exact = exact.lerp(g, 1 - beta)
        measured = t >= steps // 2
        O_exact = update(exact, g, "bf16") if measured else None
        for row in ROOT_STATE_ROWS:
            buf = muon._momentum_value(held[row]).lerp(g, 1 - beta)  # the step's: held m, updated in FP32
            if measured:
                cos[row].append(_cos(update(buf, g, row[1]), O_exact))
                err[row].append(float((buf - exact).norm() / exact.norm()))
            held[row] = muon._momentum_state(buf, row[0], t * 65536 + 1)
    return {row: (sum(cos[row]) / len(cos[row]), sum(err[row]) / len(err[row])) for row in ROOT_STATE_ROWS}


def lm_entry(entry):
    """A --root-lm-rows entry -> (muon.build name, keywords). 'S/N': root with ROOT's momentum in
    S and Newton-Schulz in N, the AdamW part FP32 (build(states=S) would put it in NVFP4 too);
    'name' or 'name:key=value:...': that optimizer as build() makes it, e.g. root_fp4, or
    root_fp4:ns=bf16:state=fp32 (its AdamW part alone in FP4)."""
    if "/" in entry:
        state, ns = entry.split("/")
        return "root", dict(state=state, ns=ns)
    name, *kv = entry.split(":")
    return name, dict(x.split("=") for x in kv)


def section_root_states(args):
    """Rows per (shape, gradient noise, momentum state, Newton-Schulz precision): momentum_replay's
    update cosine and momentum error; with --root-lm N also the tiny LM's val loss after N steps
    of the optimizers of --root-lm-rows (lm_entry) per seed of --root-lm-seeds."""
    import muon
    rows = []
    for shape in [tuple(int(d) for d in s.split("x")) for s in args.root_shapes.split(",") if s]:
        for noise in (0.3, 3.0):
            t0 = time.time()
            for (state, ns), (c, e) in momentum_replay(shape, noise, args.root_steps).items():
                rows.append(dict(shape=f"{shape[0]}x{shape[1]}", noise=noise, state=state, ns=ns,
                                 update_cos=round(c, 4), momentum_rel_err=round(e, 4)))
                print_table_row(rows[-1], ROOT_STATE_COLS)
            print(f"  {shape} noise {noise}: {time.time() - t0:.0f} s")
    get = _lm_batches() if args.root_lm else None
    if args.root_lm and get is None:
        print("  data/pycode not prepared: no tiny-LM runs (python data/pycode/prepare.py)")
    seeds = [int(s) for s in args.root_lm_seeds.split(",")]
    for entry in [e for e in args.root_lm_rows.split(",") if e] if get else []:
        name, kw = lm_entry(entry)
        preset = muon.build(torch.nn.Linear(16, 16), name, **kw).parts[0].defaults
        state, ns = preset.get("state"), preset.get("ns")
        make = lambda net: muon.build(net, name, lr=3e-3, **kw)  # noqa: E731
        val = [_tiny_lm_run(get, args.root_lm, s, 3e-3, make_opt=make)[2] for s in seeds]
        rows.append(dict(shape="tiny LM", noise=None, state=state, ns=ns, optimizer="root" if "/" in entry else entry,
                         lm_steps=args.root_lm, lm_val=[round(v, 4) for v in val]))
        print_table_row(rows[-1], ROOT_STATE_COLS)
    return rows


# ---------------------------------------------------------------------------------------------
# ns: Newton-Schulz in FP4 (newton_schulz.py, SPEC 8.2): quality per design at every 2-D block shape of the
# 30m and 1b models (runs on a CPU too)

NS_PRECISIONS = [("fp32", "-"), ("bf16", "-")] + [("nvfp4", d) for d in ("naive", "residual", "bf16_tail", "compensated_tail")]


def power_law_matrix(shape, alpha, seed=0):
    """U diag(i^-alpha) V^T with Haar-random U, V (FP64): a decaying spectrum of known SVD."""
    g = torch.Generator().manual_seed(seed)
    m, n = shape
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))
    return (u * torch.arange(1, k + 1, dtype=torch.float64) ** -alpha) @ v.T


def momentum_matrices(path):
    """{shape: a middle layer's momentum buffer} from a train.py checkpoint of a Muon/ROOT run."""
    ck = torch.load(path, map_location="cpu", weights_only=False)
    sd = ck["optimizer"]
    parts = sd["parts"] if "parts" in sd else [sd]
    found = {}
    for part in parts:
        for st in part["state"].values():
            if "momentum_buffer" in st and st["momentum_buffer"].ndim == 2:
                found.setdefault(tuple(st["momentum_buffer"].shape), []).append(st["momentum_buffer"].float())
    return {shape: bufs[len(bufs) // 2] for shape, bufs in found.items()}


def ns_quality(G, P, abc, precision, design):
    """cosine of newton_schulz(G) to the exact polar factor P, its singular values, GEMM FLOP shares."""
    import newton_schulz
    stats = {}
    X = newton_schulz.newton_schulz(G, 5, abc, precision, design if design != "-" else "compensated_tail", stats).double()
    small = X if X.shape[0] <= X.shape[1] else X.T
    s = torch.linalg.eigvalsh(small @ small.T).clamp(min=0).sqrt()  # singular values; faster than svdvals
    total = sum(stats.values())
    return dict(cos=round(float((X * P).sum() / (X.norm() * P.norm())), 4),
                sv_min=round(float(s.min()), 3), sv_med=round(float(s.median()), 3), sv_max=round(float(s.max()), 3),
                fp4_share=round(stats.get("nvfp4", 0) / total, 3),
                gemm_flops=total,
                _cost=stats.get("nvfp4", 0) / FP4_SPEEDUP + stats.get("bf16", 0) + stats.get("fp32", 0))


def _ns_sources(shape, momenta):
    """(source name, matrix, coefficients key) per input: a power-law spectrum (s_i = 1/i), a
    Gaussian matrix (Marchenko-Pastur spectrum: flat, no dominant direction, the hard case), and
    each run's momentum as Muon sees it (raw, Muon's coefficients) and as ROOT does
    (soft-thresholded, ROOT's coefficients)."""
    import muon
    yield "power1", power_law_matrix(shape, 1.0), "root"
    yield "gauss", torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64), "root"
    for tag, mats in momenta.items():
        if shape in mats:
            yield f"{tag}", mats[shape], "muon"
            yield f"{tag}+soft", muon.soft_threshold(mats[shape], 0.9), "root"


def section_ns(args):
    import newton_schulz
    device = "cuda" if torch.cuda.is_available() else "cpu"
    momenta = {os.path.basename(os.path.dirname(p)) or p: momentum_matrices(p) for p in args.momentum}
    rows = []
    for size in args.ns_sizes.split(","):
        for name, shape in ns_shapes(size).items():
            for source, G, coef in _ns_sources(shape, momenta):
                G = G.to(device)
                u, _, vh = torch.linalg.svd(G.double(), full_matrices=False)
                P = u @ vh  # the exact polar factor U V^T
                abc = newton_schulz.ns_coefficients(shape, coef)
                base = None
                for precision, design in NS_PRECISIONS:
                    t = time.time()
                    r = ns_quality(G, P, abc, precision, design)
                    base = base or r
                    rows.append(dict(size=size, matrix=name, shape=f"{shape[0]}x{shape[1]}", source=source,
                                     coef="muon" if abc == newton_schulz.MUON_COEFFICIENTS else "root",
                                     precision=precision, design=design, **{k: v for k, v in r.items() if not k.startswith("_")},
                                     d_cos_vs_bf16=None, cost_vs_bf16=round(r["_cost"] / base["_cost"], 3), s=round(time.time() - t, 1)))
                    print_table_row(rows[-1], NS_COLS)
                bf16 = next(r for r in rows[-len(NS_PRECISIONS):] if r["precision"] == "bf16")
                for r in rows[-len(NS_PRECISIONS):]:
                    r["d_cos_vs_bf16"] = round(r["cos"] - bf16["cos"], 4)
    print()
    print_table(rows, NS_COLS)
    return rows


NS_COLS = ["size", "matrix", "shape", "source", "coef", "precision", "design", "cos", "d_cos_vs_bf16",
           "sv_min", "sv_med", "sv_max", "fp4_share", "cost_vs_bf16", "s"]


# ---------------------------------------------------------------------------------------------
# ns_uneven: Newton-Schulz in FP4 on matrices whose rows or columns have uneven norms (momentum:
# some output channels carry most of the gradient); docs/newton_schulz_uneven.md

NS_UNEVEN_DESIGNS = [("fp32", "-"), ("bf16", "-"), ("nvfp4", "compensated_tail"), ("nvfp4", "diagonal_tail")]


def scaled_gaussian(shape, axis, norms, seed):
    """A Gaussian matrix (FP64) with row (axis 0) or column (axis 1) i scaled by norms[i]."""
    Z = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return Z * (norms[:, None] if axis == 0 else norms[None, :])


def _uneven_sources(shape, spreads, seeds, momenta):
    """(name, matrix) per input: norms log-uniform over spread:1 (both ends drawn) along rows or
    columns, a few (5%) rows or columns 1000x the rest, and each run's momentum (raw and
    soft-thresholded, as ROOT sees it)."""
    import muon
    for axis, where in ((0, "rows"), (1, "cols")):
        n = shape[axis]
        for spread in spreads:
            for seed in seeds:
                u = torch.rand(n, generator=torch.Generator().manual_seed(1000 + seed), dtype=torch.float64)
                u = (u - u.min()) / (u.max() - u.min())
                yield f"{where} log-uniform {spread:g}:1 seed {seed}", scaled_gaussian(shape, axis, spread ** -u, seed)
        norms = torch.ones(n, dtype=torch.float64)
        norms[torch.randperm(n, generator=torch.Generator().manual_seed(7))[: n // 20]] = 1000.0
        yield f"{where} 5% at 1000:1", scaled_gaussian(shape, axis, norms, 0)
    for tag, mats in momenta.items():
        if shape in mats:
            yield tag, mats[shape].double()
            yield f"{tag}+soft", muon.soft_threshold(mats[shape], 0.9).double()


def _norm_spread(G, dim):
    n = G.norm(dim=dim)
    return round(float(n.max() / n.min().clamp(min=1e-300)), 1)


def section_ns_uneven(args):
    """Per shape of --ns-sizes and input: each design's cosine to U V^T, its difference to BF16's and
    FP32's, the largest singular value, the GEMM FLOP share in NVFP4, the projected Blackwell GEMM
    cost against BF16 (from FLOPs, FP4_SPEEDUP), and the seconds this machine took (CPU: the FP4
    GEMMs emulated in FP32, so these seconds say nothing of a GPU)."""
    import newton_schulz
    momenta = {os.path.basename(os.path.dirname(p)) or p: momentum_matrices(p) for p in args.momentum}
    spreads = [float(v) for v in args.uneven_spreads.split(",")]
    seeds = [int(v) for v in args.uneven_seeds.split(",")]
    rows = []
    for size in args.ns_sizes.split(","):
        for name, shape in ns_shapes(size).items():
            abc = newton_schulz.ns_coefficients(shape, "muon")
            for source, G in _uneven_sources(shape, spreads, seeds, momenta):
                u, _, vh = torch.linalg.svd(G, full_matrices=False)
                G, P = G.float(), u @ vh
                got = []
                for precision, design in NS_UNEVEN_DESIGNS:
                    t = time.time()
                    r = ns_quality(G, P, abc, precision, design)
                    got.append(dict(size=size, matrix=name, shape=f"{shape[0]}x{shape[1]}", source=source,
                                    row_spread=_norm_spread(G, 1), col_spread=_norm_spread(G, 0),
                                    precision=precision, design=design, **{k: v for k, v in r.items() if not k.startswith("_")},
                                    cost=r["_cost"], cpu_s=round(time.time() - t, 2)))
                ref = {r["precision"]: r for r in got[:2]}
                for r in got:
                    r["d_cos_vs_bf16"] = round(r["cos"] - ref["bf16"]["cos"], 4)
                    r["d_cos_vs_fp32"] = round(r["cos"] - ref["fp32"]["cos"], 4)
                    r["cost_vs_bf16"] = round(r.pop("cost") / (ref["bf16"]["gemm_flops"]), 3)
                    print_table_row(r, NS_UNEVEN_COLS)
                rows += got
    print()
    print_table(rows, NS_UNEVEN_COLS)
    return rows


NS_UNEVEN_COLS = ["matrix", "shape", "source", "row_spread", "col_spread", "precision", "design", "cos",
                  "d_cos_vs_bf16", "d_cos_vs_fp32", "sv_max", "fp4_share", "cost_vs_bf16", "cpu_s"]


# ---------------------------------------------------------------------------------------------
# lora_rank: how much the fullstack recipe's BF16 rank-r part (LoRA-SVD, SPEC 8.4) cuts a linear
# layer's FP4 quantization error, by rank: the measurement behind the default rank (docs/fullstack.md,
# "LoRA-SVD and the fullstack recipe").
#
# For a weight W (N, K), inputs X (M, K) and output gradients E (M, N), one FP4Linear's relative
# errors against FP32: output ||Y - X W^T|| / ||X W^T||, input gradient ||dX - E W|| / ||E W|| and
# weight gradient ||dW - E^T X|| / ||E^T X||; the two gradients are root-mean-square over `calls`
# backward calls (fresh stochastic rounding each). Synthetic weights: W = U diag(s) V^T with random
# orthonormal U, V and s_i = (1 + i)^-alpha; X and E Gaussian. A checkpoint: every block linear,
# with the activations and output gradients of one batch of its own validation data.

def layer(w, recipe, rank):
    """An FP4Linear holding w under recipe (fullstack: with lora_rank = rank, L fitted)."""
    n, k = w.shape
    lin = linear.FP4Linear(k, n, recipe=recipe, device=w.device, **({"lora_rank": rank} if recipe == "fullstack" else {}))
    lin.weight.data.copy_(w)
    linear.refit_lora(lin)
    return lin


def rel(a, b):
    return float((a.detach().float() - b.float()).norm() / b.float().norm())


def errors(lin, x, e, calls):
    """Relative errors of lin's output, input gradient and weight gradient against FP32."""
    w = lin.weight.detach()
    y_ref, dx_ref, dw_ref = x @ w.t(), e @ w, e.t() @ x
    out, dx2, dw2, dx_sum, dw_sum = 0.0, 0.0, 0.0, 0.0, 0.0
    for c in range(calls):
        torch.manual_seed(c)  # the backward's seeds and signs
        xg = x.clone().requires_grad_()
        lin.weight.grad = None
        y = lin(xg)
        y.backward(e)
        out = rel(y, y_ref)  # round to nearest: the same every call
        dx2 += rel(xg.grad, dx_ref) ** 2 / calls
        dw2 += rel(lin.weight.grad, dw_ref) ** 2 / calls
        dx_sum, dw_sum = dx_sum + xg.grad, dw_sum + lin.weight.grad
    # the error of the mean over the calls: the bias, plus what is left of the noise (1/sqrt(calls))
    return dict(out=out, dgrad=math.sqrt(dx2), wgrad=math.sqrt(dw2),
                dgrad_mean=rel(dx_sum / calls, dx_ref), wgrad_mean=rel(dw_sum / calls, dw_ref))


def rank_variants(ranks):
    """(label, recipe, rank) rows: the other NVFP4 recipes, fullstack without L, with rank r."""
    return ([("nvfp4", "nvfp4", None), ("quartet2", "quartet2", None), ("fullstack r=none", "fullstack", -1)]
            + [(f"fullstack r={r}", "fullstack", r) for r in ranks])


def rank_rows(cases, ranks, calls):
    """cases: {group: [(W, X, E), ...]} -> rows, each error the mean over the group's layers and
    the fullstack rows' reductions against fullstack without L (four_over_six NVFP4)."""
    rows = []
    for group, layers in cases.items():
        base = None
        for label, recipe, rank in rank_variants(ranks):
            if rank is not None and rank > min(min(w.shape) for w, _, _ in layers):
                continue
            errs = [errors(layer(w, recipe, rank), x, e, calls) for w, x, e in layers]
            row = dict(weights=group, variant=label, **{k: float(np.mean([d[k] for d in errs])) for k in errs[0]})
            base = row if rank == -1 else base
            if rank is not None and rank > 0:
                row.update({f"{k}_cut_pct": 100 * (1 - row[k] / base[k]) for k in ("out", "dgrad")})
                energy = [top_energy(w, rank) for w, _, _ in layers]
                row["top_r_energy"] = float(np.mean(energy))
                # the error scales with ||R||_F = sqrt(1 - energy) ||W||_F: the cut it predicts
                row["predicted_cut_pct"] = float(np.mean([100 * (1 - math.sqrt(1 - f)) for f in energy]))
            rows.append(row)
            print_row(row)
    return rows


def top_energy(w, rank):
    """The fraction of ||W||_F^2 in the top `rank` singular values: what L takes out of R."""
    s2 = torch.linalg.svdvals(w.double()).square()
    return float(s2[:rank].sum() / s2.sum())


def print_row(r):
    cut = "".join(f"  {k} -{r[k + '_cut_pct']:.1f}%" for k in ("out", "dgrad") if k + "_cut_pct" in r)
    if "top_r_energy" in r:
        cut += f"  top-r energy {r['top_r_energy']:.3f} (predicts -{r['predicted_cut_pct']:.1f}%)"
    print(f"{r['weights']:>24} {r['variant']:>18}  out {r['out']:.4f}  dgrad {r['dgrad']:.4f}  wgrad {r['wgrad']:.4f}"
          f"  (means: {r['dgrad_mean']:.4f} {r['wgrad_mean']:.4f}){cut}")


# ---------------------------------------------------------------------------------------------
# lora_rank's weights: synthetic spectra and a trained checkpoint

def synthetic(n, k, alpha, m, seed):
    """W (n, k) with singular values (1 + i)^-alpha and random singular vectors, scaled to an
    init-like RMS of 0.02; X (m, k) and E (m, n) Gaussian."""
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(n, min(n, k), generator=g)).Q
    v = torch.linalg.qr(torch.randn(k, min(n, k), generator=g)).Q
    s = (1 + torch.arange(min(n, k), dtype=torch.float32)) ** -alpha
    w = (u * s) @ v.t()
    w = w * (0.02 / w.square().mean().sqrt())
    return w, torch.randn(m, k, generator=g), torch.randn(m, n, generator=g)


def from_checkpoint(path, m):
    """[(W, X, E)] for every block linear of a train.py checkpoint, X and E from the first m
    tokens (one row of batch) of its validation split, in FP32 without quantization."""
    import model as llama
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    args = {k: v for k, v in ckpt["model_args"].items() if k in llama.GPTConfig.__dataclass_fields__}
    net = llama.GPT(llama.GPTConfig(**args))
    net.load_state_dict({k: v for k, v in ckpt["model"].items() if not k.endswith(("lora_us", "lora_v"))})
    cfg = ckpt["config"]
    data_dir = cfg.get("data_dir") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", cfg["dataset"])
    t = args["block_size"]
    tokens = np.memmap(os.path.join(data_dir, "val.bin"), dtype=np.uint32, mode="r")[: m + 1].astype(np.int64)
    idx = torch.from_numpy(tokens)
    x, y = idx[:-1].view(-1, t), idx[1:].view(-1, t)  # (m / T, T)
    linears = {n: mod for n, mod in net.transformer.h.named_modules() if isinstance(mod, torch.nn.Linear)}
    xs, es = {}, {}

    def keep_x(mod, inp, out):
        xs[mod] = inp[0].reshape(-1, mod.in_features).detach()  # (M, K)

    def keep_e(mod, grad_in, grad_out):
        es[mod] = grad_out[0].reshape(-1, mod.out_features)  # (M, N)

    for mod in linears.values():
        mod.register_forward_hook(keep_x)
        mod.register_full_backward_hook(keep_e)
    _, loss = net(x, y)
    loss.backward()
    return [(mod.weight.detach().clone(), xs[mod], es[mod]) for mod in linears.values()], ckpt.get("iter_num")


def checkpoint_lora(ckpt):
    """{index of the block linear in from_checkpoint's order: (U_r S_r, V_r)}: the L factors a
    fullstack checkpoint (as torch.load gives it) holds, as fitted at its last refit; {} for the
    other recipes."""
    sd = ckpt["model"]
    names = [k[:-len(".weight")] for k in sd if k.startswith("transformer.h.") and k.endswith(".weight")
             and sd[k].ndim == 2]  # the block linears, in module order (norm weights are 1-D)
    return {i: (sd[n + ".lora_us"].float(), sd[n + ".lora_v"].float()) for i, n in enumerate(names)
            if n + ".lora_us" in sd and sd[n + ".lora_us"].numel()}


def held_lora_rows(path, layers, it, calls):
    """A fullstack checkpoint's block linears with the L they hold (fitted at the run's last refit,
    every lora_refit_interval steps), with L refitted to the same W at the same rank, and with no
    L: how much of L's error cut is left once W has moved on from what L was fitted to. Also
    ||W - L|| / ||W|| per variant (Eckart-Young: no rank-r L leaves less than the refit, up to the
    randomized SVD's own error)."""
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    held = checkpoint_lora(ckpt)
    if not held:
        return []
    interval = ckpt["config"].get("lora_refit_interval")
    group = f"checkpoint (step {it}, refit every {interval})"
    per = {"fullstack r=none": [], "fullstack, L as held": [], "fullstack, L refitted": []}
    for i, (us, v) in held.items():
        w, x, e = layers[i]
        if (us.shape[0], v.shape[0]) != tuple(w.shape):
            raise ValueError(f"{path}: block linear {i}'s L is {us.shape[0]}x{v.shape[0]}, its weight {tuple(w.shape)}")
        stale = layer(w, "fullstack", us.shape[1])
        fresh = layer(w, "fullstack", us.shape[1])
        stale.lora_us.copy_(us)
        stale.lora_v.copy_(v)
        for label, lin in (("fullstack r=none", layer(w, "fullstack", -1)), ("fullstack, L as held", stale),
                           ("fullstack, L refitted", fresh)):
            low = lin.lora_us.float() @ lin.lora_v.float().t() if lin.lora_rank else torch.zeros_like(w)
            per[label].append(dict(errors(lin, x, e, calls), residual=rel(low, w)))  # ||W - L|| / ||W||
    rows, base = [], None
    for label, errs in per.items():
        row = dict(weights=group, variant=label, **{k: float(np.mean([d[k] for d in errs])) for k in errs[0]})
        base = base or row
        if row is not base:
            row.update({f"{k}_cut_pct": 100 * (1 - row[k] / base[k]) for k in ("out", "dgrad")})
        rows.append(row)
        print_row(row)
    return rows


# ---------------------------------------------------------------------------------------------
# lora_rank: the backward treatments compared (the recipe's choice, docs/fullstack.md)

_NVFP4_DGRAD = dict(dgrad_e=dict(rounding="sr"), dgrad_w=dict(rounding="rn", scale_rule="four_over_six"))
_NVFP4_WGRAD = dict(wgrad_e=dict(rounding="sr", hadamard=16), wgrad_x=dict(rounding="rn", hadamard=16))
BACKWARDS = {  # nvfp4's dgrad reuses 16x16 weight tiles; R is four_over_six 1x16, so it is re-quantized RN
    "nvfp4 (E: SR; wgrad RHT-16)": {**_NVFP4_DGRAD, **_NVFP4_WGRAD},
    "quartet2 (RHT-128 + MS-EDEN)": dict(dgrad_e=linear._EDEN, dgrad_w=linear._EDEN, wgrad_e=linear._EDEN, wgrad_x=linear._EDEN),
    "nvfp4 dgrad, MS-EDEN wgrad": dict(**_NVFP4_DGRAD, wgrad_e=linear._EDEN, wgrad_x=linear._EDEN),
    "MS-EDEN dgrad, nvfp4 wgrad": dict(dgrad_e=linear._EDEN, dgrad_w=linear._EDEN, **_NVFP4_WGRAD),
}


@contextmanager
def fullstack_backward(change):
    """RECIPES['fullstack'] with some backward operands' treatment replaced, for the duration."""
    saved = linear.RECIPES["fullstack"]
    linear.RECIPES["fullstack"] = {**saved, **change}
    try:
        yield
    finally:
        linear.RECIPES["fullstack"] = saved


def compare_backwards(cases, rank, calls):
    rows = []
    for group, layers in cases.items():
        for label, change in BACKWARDS.items():
            with fullstack_backward(change):
                errs = [errors(layer(w, "fullstack", rank), x, e, calls) for w, x, e in layers]
            row = dict(weights=group, variant=label, **{k: float(np.mean([d[k] for d in errs])) for k in errs[0]})
            rows.append(row)
            print_row(row)
    return rows


def section_lora_rank(args):
    """Rows per weight group (--synthetic shapes at alpha 0.5 and 1, --ckpt's block linears) and
    variant (rank_variants); with --backward also the backward treatments at --backward-rank."""
    cases = {}
    for shape in filter(None, args.synthetic.split(",")):
        n, k = map(int, shape.split("x"))
        for alpha in (0.5, 1.0):
            cases[f"{n}x{k} s_i=(1+i)^-{alpha}"] = [synthetic(n, k, alpha, args.tokens, seed) for seed in range(2)]
    if args.ckpt:
        layers, it = from_checkpoint(args.ckpt, args.tokens)
        cases[f"checkpoint (step {it})"] = layers
        held = held_lora_rows(args.ckpt, [tuple(t.to(args.device) for t in case) for case in layers], it, args.calls)
    cases = {g: [tuple(t.to(args.device) for t in case) for case in layers] for g, layers in cases.items()}
    rows = rank_rows(cases, [int(r) for r in args.ranks.split(",")], args.calls)
    rows += held if args.ckpt else []
    if args.backward:
        rows += compare_backwards(cases, args.backward_rank, args.calls)
    return rows


# ---------------------------------------------------------------------------------------------
# the command line: sections, their options, where their rows go

SECTIONS = {"ns": section_ns, "ns_uneven": section_ns_uneven, "states": section_states,
            "root_states": section_root_states, "lora_rank": section_lora_rank}
FILES = {"ns": "bench_ns.json", "ns_uneven": "optim/ns_uneven.json", "states": "bench_states.json",
         "root_states": "measure_root_states.json", "lora_rank": "lora_rank.json"}  # results/<gpu>/


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--sections", required=True, help=f"comma list of {list(SECTIONS)}")
    ap.add_argument("--out", default=None, help="folder for the JSON (default results/<gpu-name-slug>), "
                    "or with one section the .json file itself")
    ap.add_argument("--ns-sizes", default="30m,1b", help="ns: model.SIZES names whose block shapes to test")
    ap.add_argument("--momentum", nargs="*", default=[], metavar="CKPT",
                    help="ns: train.py checkpoints of Muon/ROOT runs whose momentum matrices to test")
    ap.add_argument("--uneven-spreads", default="1,10,100,1000", help="ns_uneven: row/column norm spreads (log-uniform)")
    ap.add_argument("--uneven-seeds", default="0,1", help="ns_uneven: seeds per spread")
    ap.add_argument("--states-lm", type=int, default=0, help="states: also train the tiny LM this many steps per format and seed (CPU: ~2 min a run)")
    ap.add_argument("--root-shapes", default="640x640,640x1792", help="root_states: comma list of RxC matrix shapes")
    ap.add_argument("--root-steps", type=int, default=60, help="root_states: steps of the momentum replay")
    ap.add_argument("--root-lm", type=int, default=0, help="root_states: also train the tiny LM this many steps per format and seed")
    ap.add_argument("--root-lm-seeds", default="0,1", help="root_states: the tiny LM's seeds")
    ap.add_argument("--root-lm-rows", default=",".join(f"{a}/{b}" for a, b in ROOT_STATE_ROWS),
                    help="root_states: the tiny LM's rows: state/ns pairs (ROOT's momentum alone) or muon.build "
                         "names, with keywords as name:key=value (root_fp4:ns=bf16:state=fp32: its AdamW part alone in FP4)")
    ap.add_argument("--ckpt", default=None, help="lora_rank: a train.py checkpoint: measure its block linears too")
    ap.add_argument("--ranks", default="8,16,32,64,128", help="lora_rank: comma list of ranks")
    ap.add_argument("--tokens", type=int, default=1024, help="lora_rank: rows of X (a multiple of 128)")
    ap.add_argument("--calls", type=int, default=4, help="lora_rank: backward calls per gradient error")
    ap.add_argument("--backward", action="store_true", help="lora_rank: also compare backward treatments (at --backward-rank)")
    ap.add_argument("--backward-rank", type=int, default=0, help="lora_rank: fullstack rank for --backward (0: the default rule)")
    ap.add_argument("--synthetic", default="640x640,1792x640", help="lora_rank: comma list of NxK shapes ('' for none)")
    ap.add_argument("--device", default="cpu", help="lora_rank: where the layers run (cuda: the kernels and cuBLAS)")
    args = ap.parse_args(argv)
    args.sections = args.sections.split(",")
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        ap.error(f"--sections: unknown {', '.join(unknown)}; allowed: {', '.join(SECTIONS)}")
    if args.out and args.out.endswith(".json") and len(args.sections) > 1:
        ap.error(f"--out {args.out}: a .json file holds one section's rows, not {len(args.sections)}; give a folder")
    return args


def out_path(args, name):
    """Where section `name` writes: --out when it names a .json file, else FILES[name] in the
    --out folder (default results/<gpu-name-slug>)."""
    if args.out and args.out.endswith(".json"):
        return args.out
    return os.path.join(args.out or os.path.join("results", bench_io.gpu_slug()), FILES[name])


def main(argv=None):
    args = parse(argv)
    args.meta = dict(bench_io.run_meta(), args=dict(vars(args)))
    for name in args.sections:
        print(f"\n== {name} ==")
        rows = SECTIONS[name](args)
        path = out_path(args, name)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        bench_io.save_rows(args, name, rows, path)


if __name__ == "__main__":
    main()
