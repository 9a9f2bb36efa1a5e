"""Speed and memory, side by side, in one run: python bench.py [--sections kernels,...] [--out results/<gpu>/]

Each section is one function that returns rows (dicts); every row is printed in a table and the
section's rows are written to results/<gpu-name-slug>/bench_<section>.json with the run's meta
(device, versions, backends, commit). bench_ops.py holds the per-operation sections (kernels,
linear, attention, optim, ...), bench_step.py the whole-model ones (step, saved, step_profile,
fsdp); this file is the command line.

$ python bench.py --sections step --step-variants bf16,float8-tensorwise,quartet,nvfp4   # 1B step
$ python bench.py --sections step --step-variants bf16,quartet,quartet+bf16-tail         # FP4 part, BF16 tail
$ python bench.py --sections kernels,linear                                             # operations
"""
import argparse
import json
import os

import torch

import bench_step
from bench_io import gpu_slug, run_meta, save_rows
from bench_ops import CPU_SECTIONS, ON_REQUEST, SECTIONS
from train import COMPILE_MODES


def compare_runs(paths, out_png):
    """One loss-curve figure from several train.py summary.json files (same tokens, one per recipe)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for path in paths:
        s = json.load(open(path))
        c = s["loss_curve"]
        line, = ax.plot(c["steps"], c["train_loss"], lw=0.8, alpha=0.6)
        ax.plot(c["val_steps"], c["val_loss"], "o-", color=line.get_color(),
                label=f"{s['recipe']}: val {s['val_loss']:.4f}")
    ax.set(xlabel="step", ylabel="loss", ylim=(3.5, 7), title=f"{s['model_size']}, {s['tokens']:,} tokens, {s['device']}")
    ax.legend()
    fig.savefig(out_png, dpi=120, bbox_inches="tight")
    print(f"wrote {out_png}")


def all_sections():
    """Every section by name: bench_ops.py's (one operation at a time), then bench_step.py's (the
    whole model), then the multi-GPU ones, which no default includes."""
    return {**SECTIONS, **bench_step.SECTIONS}, bench_step.SECTIONS_MULTI_GPU, bench_step.STEP_VARIANTS


def main():
    sections, multi_gpu, step_variants = all_sections()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default=",".join(s for s in sections if s not in CPU_SECTIONS | ON_REQUEST),
                    help=f"comma list of {list(sections)}, or fsdp (default: all but {sorted(CPU_SECTIONS | ON_REQUEST)})")
    ap.add_argument("--out", default=None, help="folder for the JSON (default results/<gpu-name-slug>)")
    ap.add_argument("--tokens", type=int, default=16384, help="linear: tokens (rows of X)")
    ap.add_argument("--model", default="1b", help="step: a model.SIZES name")
    ap.add_argument("--seq", type=int, default=2048, help="step: sequence length")
    ap.add_argument("--batch", type=int, default=8, help="step: sequences per step")
    ap.add_argument("--step-reps", type=int, default=4, help="step: timed steps")
    ap.add_argument("--compile-mode", default="default", choices=COMPILE_MODES,
                    help="step, step_profile: torch.compile's mode (reduce-overhead: CUDA graphs, which time one fixed-batch step; train.py refuses them: docs/speed.md)")
    ap.add_argument("--step-variants", default=",".join(step_variants),
                    help="step: comma list (model.RECIPES names, fp8-rowwise, float8-tensorwise, float8-rowwise; '+attn-nvfp4' adds FP4 attention; '+bf16-tail' times an FP4 recipe's BF16 tail (train.py --fp4_until); "
                         "'name:optimizer[:loss_chunk[:recompute]]' is that one row); bf16 first")
    ap.add_argument("--step-eager", action="store_true", help="step: also time every variant eager (second table)")
    ap.add_argument("--gpus", default="2", help="fsdp: comma list of GPU counts (torchrun --nproc_per_node)")
    ap.add_argument("--fsdp-iters", type=int, default=20, help="fsdp: train.py --max_iters")
    ap.add_argument("--fsdp-recipe", default="quartet", help="fsdp: comma list of train.py recipes")
    ap.add_argument("--fsdp-compile", default="True", choices=("True", "False"), help="fsdp: train.py --compile")
    ap.add_argument("--step-optimizers", default="adamw", help="step: comma list of muon.OPTIMIZERS (each variant with each)")
    ap.add_argument("--step-loss-chunk", default="0", help="step: comma list of GPTConfig.loss_chunk values (0: whole logits)")
    ap.add_argument("--step-accum", default="1", help="step, step_profile: comma list of gradient accumulations "
                    "(micro-steps of --batch sequences an optimizer step; each row against BF16 at the same one)")
    ap.add_argument("--step-recompute", default="none", help="step, saved: comma list of GPTConfig.recompute values (none, mlp)")
    ap.add_argument("--saved-compiled", action="store_true", help="saved: also the compiled forward's total (compiles each row)")
    ap.add_argument("--step-saved", action="store_true", help="step: also count each row's saved bytes, compiled and eager (more forwards)")
    ap.add_argument("--optim-reps", type=int, default=5, help="optim: timed optimizer steps")
    ap.add_argument("--compare", nargs="+", default=None, metavar="SUMMARY_JSON",
                    help="no benchmark: plot these train.py summaries into one PNG (--out names it)")
    args = ap.parse_args()
    unknown = [s for s in args.sections.split(",") if s not in sections and s not in multi_gpu]
    if unknown:
        raise SystemExit(f"bench.py: unknown section {', '.join(unknown)}; choose from {', '.join([*sections, *multi_gpu])}")
    if args.compare:
        return compare_runs(args.compare, args.out or "loss_curves.png")
    if not torch.cuda.is_available() and set(args.sections.split(",")) - CPU_SECTIONS:
        raise SystemExit(f"bench.py needs a CUDA device (without one, only --sections {','.join(CPU_SECTIONS)})")
    out = args.out or os.path.join("results", gpu_slug())
    os.makedirs(out, exist_ok=True)
    args.out_dir, args.meta = out, run_meta()
    for name in args.sections.split(","):
        print(f"\n== {name} ==")
        save_rows(args, name, {**sections, **multi_gpu}[name](args))


if __name__ == "__main__":
    main()
