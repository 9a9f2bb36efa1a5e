"""
How much the fullstack recipe's BF16 rank-r part (LoRA-SVD, SPEC 8.4) cuts a linear layer's FP4
quantization error, by rank: the measurement behind the default rank (README, "LoRA-SVD and the
fullstack recipe").

$ python lora_rank.py                                     # weights with decaying spectra
$ python lora_rank.py --ckpt out/ckpt.pt                  # + a trained checkpoint's block linears
$ python lora_rank.py --ckpt out/ckpt.pt --backward       # + the backward treatments compared
$ python lora_rank.py --device=cuda --synthetic=2048x2048 --ranks=32,128 --calls=2   # a GPU check

For a weight W (N, K), inputs X (M, K) and output gradients E (M, N), one FP4Linear's relative
errors against FP32: output ||Y - X W^T|| / ||X W^T||, input gradient ||dX - E W|| / ||E W|| and
weight gradient ||dW - E^T X|| / ||E^T X||; the two gradients are root-mean-square over `calls`
backward calls (fresh stochastic rounding each). Synthetic weights: W = U diag(s) V^T with random
orthonormal U, V and s_i = (1 + i)^-alpha; X and E Gaussian. A checkpoint: every block linear,
with the activations and output gradients of one batch of its own validation data.
"""
import argparse
import json
import math
import os
from contextlib import contextmanager

import numpy as np
import torch

import fp4

# ---------------------------------------------------------------------------------------------
# the layers under test and their errors

def layer(w, recipe, rank):
    """An FP4Linear holding w under recipe (fullstack: with lora_rank = rank, L fitted)."""
    n, k = w.shape
    lin = fp4.FP4Linear(k, n, recipe=recipe, device=w.device, **({"lora_rank": rank} if recipe == "fullstack" else {}))
    lin.weight.data.copy_(w)
    fp4.refit_lora(lin)
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


def variants(ranks):
    """(label, recipe, rank) rows: the other NVFP4 recipes, fullstack without L, with rank r."""
    return ([("nvfp4", "nvfp4", None), ("quartet2", "quartet2", None), ("fullstack r=none", "fullstack", -1)]
            + [(f"fullstack r={r}", "fullstack", r) for r in ranks])


def measure(cases, ranks, calls):
    """cases: {group: [(W, X, E), ...]} -> rows, each error the mean over the group's layers and
    the fullstack rows' reductions against fullstack without L (four_over_six NVFP4)."""
    rows = []
    for group, layers in cases.items():
        base = None
        for label, recipe, rank in variants(ranks):
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
# weights: synthetic spectra and a trained checkpoint

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


# ---------------------------------------------------------------------------------------------
# the backward treatments compared (the recipe's choice, README)

_NVFP4_DGRAD = dict(dgrad_e=dict(rounding="sr"), dgrad_w=dict(rounding="rn", scale_rule="four_over_six"))
_NVFP4_WGRAD = dict(wgrad_e=dict(rounding="sr", hadamard=16), wgrad_x=dict(rounding="rn", hadamard=16))
BACKWARDS = {  # nvfp4's dgrad reuses 16x16 weight tiles; R is four_over_six 1x16, so it is re-quantized RN
    "nvfp4 (E: SR; wgrad RHT-16)": {**_NVFP4_DGRAD, **_NVFP4_WGRAD},
    "quartet2 (RHT-128 + MS-EDEN)": dict(dgrad_e=fp4._EDEN, dgrad_w=fp4._EDEN, wgrad_e=fp4._EDEN, wgrad_x=fp4._EDEN),
    "nvfp4 dgrad, MS-EDEN wgrad": dict(**_NVFP4_DGRAD, wgrad_e=fp4._EDEN, wgrad_x=fp4._EDEN),
    "MS-EDEN dgrad, nvfp4 wgrad": dict(dgrad_e=fp4._EDEN, dgrad_w=fp4._EDEN, **_NVFP4_WGRAD),
}


@contextmanager
def fullstack_backward(change):
    """RECIPES['fullstack'] with some backward operands' treatment replaced, for the duration."""
    saved = fp4.RECIPES["fullstack"]
    fp4.RECIPES["fullstack"] = {**saved, **change}
    fp4._dim_multiple.cache_clear()
    try:
        yield
    finally:
        fp4.RECIPES["fullstack"] = saved
        fp4._dim_multiple.cache_clear()


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


def main():
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--ckpt", default=None, help="a train.py checkpoint: measure its block linears too")
    ap.add_argument("--ranks", default="8,16,32,64,128", help="comma list of ranks")
    ap.add_argument("--tokens", type=int, default=1024, help="rows of X (a multiple of 128)")
    ap.add_argument("--calls", type=int, default=4, help="backward calls per gradient error")
    ap.add_argument("--backward", action="store_true", help="also compare backward treatments (at --backward-rank)")
    ap.add_argument("--backward-rank", type=int, default=0, help="fullstack rank for --backward (0: the default rule)")
    ap.add_argument("--synthetic", default="640x640,1792x640", help="comma list of NxK shapes ('' for none)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--device", default="cpu", help="where the layers run (cuda: the kernels and cuBLAS)")
    args = ap.parse_args()
    cases = {}
    for shape in filter(None, args.synthetic.split(",")):
        n, k = map(int, shape.split("x"))
        for alpha in (0.5, 1.0):
            cases[f"{n}x{k} s_i=(1+i)^-{alpha}"] = [synthetic(n, k, alpha, args.tokens, seed) for seed in range(2)]
    if args.ckpt:
        layers, it = from_checkpoint(args.ckpt, args.tokens)
        cases[f"checkpoint (step {it})"] = layers
    cases = {g: [tuple(t.to(args.device) for t in case) for case in layers] for g, layers in cases.items()}
    rows = measure(cases, [int(r) for r in args.ranks.split(",")], args.calls)
    if args.backward:
        rows += compare_backwards(cases, args.backward_rank, args.calls)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
