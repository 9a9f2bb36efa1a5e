"""The whole model, one training step: bench.py's sections step, saved, step_profile and fsdp.

    python bench.py --sections step [--step-variants bf16,float8-tensorwise,quartet,...]

`step` times one compiled training step of the Llama per variant (tokens/s, peak memory and what
holds it) against the BF16 row of the same run: the comparison users make. `saved` counts the bytes
a forward saves for the backward, by the kind of layer; `step_profile` sums a step's GPU time by
kernel family; `fsdp` runs train.py under DDP and FSDP2 through torchrun. bench_ops.py holds the
per-operation sections, the timer and the tables these use; bench.py the command line.
"""
import json
import os
import re
import subprocess
import time
import traceback

import torch

import linear
from bench_io import bench, print_table, save_rows
from bench_ops import FP8RowwiseLinear, SkipVariant


# ---------------------------------------------------------------------------------------------
# step: one training step of the ~1B Llama per recipe (tokens/s, peak memory), same run

class FP8Linear(torch.nn.Linear):
    """The FP8 row-wise baseline as a module (all three GEMMs in E4M3, see FP8RowwiseLinear)."""

    def forward(self, x):
        y = FP8RowwiseLinear.apply(x.reshape(-1, self.in_features).to(torch.bfloat16), self.weight.to(torch.bfloat16))
        return y.view(*x.shape[:-1], self.out_features)


def _fp8_model(model):
    for name, mod in list(model.named_modules()):
        for cname, child in list(mod.named_children()):
            if type(child) is torch.nn.Linear and "lm_head" not in f"{name}.{cname}":
                new = FP8Linear(child.in_features, child.out_features, bias=False, device="meta")
                new.weight = child.weight
                setattr(mod, cname, new)
    return model


# The variants a Hopper user compares (SPEC 7): recipe names of model.RECIPES, "fp8-rowwise" (this
# file's FP8 linear), and torchao's float8 training ("float8-tensorwise", "float8-rowwise"; skipped
# with the reason where torchao is not installed). All convert the same block linears; lm_head,
# embeddings and norms stay BF16 everywhere, attention too unless a variant ends in "+attn-nvfp4"
# (attention.py's FP4 attention, SPEC 8.3). "+bf16-tail" after an FP4 recipe ("quartet+bf16-tail") is
# that recipe's model after train.py's fp4_until switch (model.to_bf16_gemms): a run's BF16 tail, to
# time beside the recipe's own row, its FP4 part.
BF16_TAIL = "+bf16-tail"
STEP_VARIANTS = ("bf16", "float8-tensorwise", "float8-rowwise", "quartet", "nvfp4", "quartet2", "fullstack",
                 "bf16+attn-nvfp4", "quartet+attn-nvfp4")


def _torchao_float8(model, recipe_name):
    """The block linears as torchao Float8Linear (model.to_float8: recipe 'float8' is 'tensorwise')."""
    import model as llama
    try:
        return llama.to_float8(model, recipe_name)
    except ImportError as err:
        raise SkipVariant(f"torchao not installed ({err.__class__.__name__}: pip install torchao)")


def _step_net(args, variant, loss_chunk=0, recompute="none", device="cuda"):
    """The ~1B Llama (args.model) for one step variant, on `device`, and its GPTConfig."""
    import model as llama
    torch.manual_seed(0)
    base, _, attn = variant.partition("+attn-")  # e.g. "quartet+attn-nvfp4": FP4 attention too
    base, tail = (base[:-len(BF16_TAIL)], True) if base.endswith(BF16_TAIL) else (base, False)
    if tail and (base not in llama.RECIPES or llama.schedule_problem(0.5, 2, base)):
        raise SkipVariant(f"{base} has no FP4 GEMMs to switch to BF16")
    cfg = llama.config_for(args.model, block_size=args.seq, attention=attn or "bf16",
                             loss_chunk=loss_chunk, recompute=recompute)
    net = llama.GPT(cfg).to(device)
    if base.startswith("float8"):  # "float8" (model.RECIPES: tensorwise), "float8-tensorwise", "float8-rowwise"
        net = _torchao_float8(net, base.partition("-")[2] or "tensorwise")
    elif base == "fp8-rowwise":
        net = _fp8_model(net)
    else:
        net = llama.apply_recipe(net, base)
        linear.refit_lora(net)  # fullstack: fit L as train.py does at step 0 (no-op for the others)
        if tail:
            llama.to_bf16_gemms(net)  # the steps after train.py's switch (fp4_until)
    return net, cfg


def _step_model(args, variant, optimizer="adamw", loss_chunk=0, recompute="none"):
    """The step variant's model on the GPU with its optimizer (as train.py makes it)."""
    net, cfg = _step_net(args, variant, loss_chunk, recompute)
    import muon  # the optimizer as train.py builds it (muon.build)
    return net, muon.build(net, optimizer, lr=1e-4, weight_decay=0.1), cfg


def _step_batch(args, cfg, device="cuda"):
    """Random token ids (B, T) and their next tokens: the step's speed does not depend on the text."""
    idx = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), device=device)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def _time_step(args, variant, compiled, optimizer="adamw", loss_chunk=0, recompute="none", accumulation=1):
    """Median step time and peak memory of one variant: autocast BF16 forward with the loss inside
    the model, backward, fused AdamW, with the model torch.compile'd as train.py does."""
    net, opt, cfg = _step_model(args, variant, optimizer, loss_chunk, recompute)
    fwd = torch.compile(net, mode=args.compile_mode) if compiled else net
    x, y = _step_batch(args, cfg)
    step = _train_step(fwd, opt, x, y, accumulation)
    t0 = time.perf_counter()
    step()  # compiles (and warms up)
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    ms = bench(step, warmup=1, reps=args.step_reps)
    peak = torch.cuda.max_memory_allocated() / 2**30
    parts = memory_parts(net, opt, step, 0 if loss_chunk else args.batch * args.seq * cfg.vocab_size)
    if args.step_saved:  # opt-in: the counts run more forwards (the hooks may recompile the model)
        try:
            parts["saved_compiled_gib"] = round(compiled_saved_bytes(net, fwd, x, y) / 2**30, 2) if compiled else None
            parts["saved_eager_gib"] = round(saved_by_kind(net, x, y)[-1]["bytes"] / 2**30, 2)
        except Exception as e:  # the timing stands without the count; the row says why it is missing
            traceback.print_exc()
            parts["saved_error"] = f"{type(e).__name__}: {e}"[:300]
    del net, opt, fwd
    return ms, peak, warm_s, parts


def _train_step(fwd, opt, x, y, accumulation=1):
    """One training step as train.py takes it: `accumulation` micro-steps of BF16 autocast forward
    with the loss inside the model and backward (the same batch each time: the speed does not
    depend on the text), then the optimizer's step."""
    def step():
        for _ in range(accumulation):
            with torch.autocast("cuda", torch.bfloat16):
                _, loss = fwd(x, y)
            (loss / accumulation).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def memory_parts(net, opt, step, logits_numel):
    """The step's peak by kind, GiB: weights, gradients (as many bytes as the weights: FP32 master
    grads), optimizer states (optim.state_bytes, after a step), logits (analytic: BF16 logits, their
    FP32 copy and FP32 gradient, B T V x 10 bytes, an upper bound where inductor fuses the loss),
    and the rest (activations saved for the backward, workspaces): peak - the others."""
    import optim
    gib = 2**-30
    weights = sum(p.numel() * p.element_size() for p in net.parameters()) * gib
    states = optim.state_bytes(opt) * gib
    torch.cuda.reset_peak_memory_stats()
    step()
    peak = torch.cuda.max_memory_allocated() * gib
    logits = logits_numel * 10 * gib
    return dict(weights_gib=round(weights, 2), grads_gib=round(weights, 2), optimizer_gib=round(states, 2),
                logits_gib=round(logits, 2), rest_gib=round(peak - 2 * weights - states - logits, 2))


def step_combos(variants, optimizers, loss_chunks, recomputes="none", accums="1"):
    """(variant, optimizer, loss_chunk, recompute, accumulation) rows: each plain variant with each
    optimizer, chunk, recompute (GPTConfig.recompute) and gradient accumulation (micro-steps an
    optimizer step), and a variant written 'name:optimizer', 'name:optimizer:chunk',
    'name:optimizer:chunk:recompute' or 'name:optimizer:chunk:recompute:accumulation' with those fixed."""
    import model as llama
    rows = []
    for item in variants.split(","):
        name, *fixed = item.split(":")
        if len(fixed) > 4:
            raise SystemExit(f"--step-variants item {item!r}: use name, name:optimizer, name:optimizer:loss_chunk, "
                             "name:optimizer:loss_chunk:recompute or name:optimizer:loss_chunk:recompute:accumulation")
        opts = [fixed[0]] if fixed else optimizers.split(",")
        chunks = [fixed[1]] if len(fixed) >= 2 else loss_chunks.split(",")
        recs = [fixed[2]] if len(fixed) >= 3 else recomputes.split(",")
        accs = [fixed[3]] if len(fixed) == 4 else str(accums).split(",")
        for r in recs:
            if r not in llama.RECOMPUTES:
                raise SystemExit(f"--step-variants item {item!r}: recompute {r!r} is not one of {', '.join(llama.RECOMPUTES)}")
        if not all(a.isdigit() and int(a) >= 1 for a in accs):
            raise SystemExit(f"--step-variants item {item!r}: accumulation must be a whole number >= 1, got {accs}")
        rows += [(name, o, int(c), r, int(a)) for o in opts for c in chunks for r in recs for a in accs]
    return rows


def section_step(args):
    """Tokens/s and peak memory per variant, compiled (the headline) and optionally eager, all
    against the BF16 row of the same mode in the same run."""
    variants = step_combos(args.step_variants, args.step_optimizers, args.step_loss_chunk, args.step_recompute,
                           args.step_accum)
    rows = []
    for compiled in (True, False) if args.step_eager else (True,):
        base = {}  # accumulation -> the BF16 row's (tokens/s, peak): each row against BF16 at its own
        for variant, optimizer, chunk, recompute, acc in variants:
            row = dict(model=args.model, variant=variant, optimizer=optimizer, loss_chunk=chunk, recompute=recompute,
                       accumulation=acc, mode="compiled" if compiled else "eager", tokens_per_step=args.batch * args.seq * acc)
            try:
                ms, peak, warm_s, parts = _time_step(args, variant, compiled, optimizer, chunk, recompute, acc)
            except SkipVariant as why:
                rows.append(dict(row, skipped=str(why)))
                print(f"  {variant}: skipped: {why}")
                continue
            except Exception as e:  # one variant's failure is a row with its error; the others still run
                traceback.print_exc()
                rows.append(dict(row, failed=f"{type(e).__name__}: {e}"[:500]))
                print(f"  {variant} {optimizer}: FAILED: {type(e).__name__}: {e}")
                continue
            finally:
                torch._dynamo.reset()
                torch.cuda.empty_cache()
            tok_s = row["tokens_per_step"] / (ms / 1000)
            if variant == "bf16" and acc not in base:
                base[acc] = (tok_s, peak)
            ref = base.get(acc)
            rows.append(dict(row, **parts, ms=round(ms, 1), tokens_per_s=round(tok_s), peak_gib=round(peak, 2),
                             first_step_s=round(warm_s, 1),
                             vs_bf16=round(tok_s / ref[0], 3) if ref else None,
                             mem_vs_bf16=round(peak / ref[1], 3) if ref else None))
            print(f"  {variant} {optimizer} loss_chunk={chunk} recompute={recompute} accumulation={acc}: "
                  f"{ms:.1f} ms, {peak:.2f} GiB", flush=True)
            save_rows(args, "step", rows)  # a call stopped at its time limit keeps the rows done
        mode = "compiled" if compiled else "eager"
        print_table([r for r in rows if r["mode"] == mode and "ms" in r],
                    ["model", "variant", "optimizer", "loss_chunk", "recompute", "accumulation", "mode", "ms", "tokens_per_s", "vs_bf16",
                     "peak_gib", "mem_vs_bf16", "first_step_s"])
        print_table([r for r in rows if r["mode"] == mode and "ms" in r],
                    ["variant", "optimizer", "loss_chunk", "recompute", "peak_gib", "weights_gib", "grads_gib", "optimizer_gib",
                     "logits_gib", "rest_gib", "saved_compiled_gib", "saved_eager_gib"])
    return rows


# ---------------------------------------------------------------------------------------------
# saved: the bytes one forward saves for the backward, by the kind of layer that saves them

def _storages(t):
    """(key, bytes) of the storages behind a saved tensor; a tensor subclass (torchao's float8)
    through its inner tensors. Two views of one storage have one key: counted once."""
    if hasattr(t, "__tensor_flatten__"):
        return [kb for name in t.__tensor_flatten__()[0] for kb in _storages(getattr(t, name))]
    st = t.untyped_storage()
    return [((t.device, st.data_ptr()), st.nbytes())]


def count_saved(fn, model, attribute=True):
    """Run fn() (a forward of `model`) under torch.autograd.graph.saved_tensors_hooks; return (its
    output, {storage key: (module, tensor, bytes)}) for every distinct storage saved for the
    backward, the module being the innermost of model's modules running when it was saved
    (attribute=False: no module hooks, which a compiled model would recompile for; then all is
    the model's). The storages of model's parameters and buffers are left out: weights, not
    activations. Keep the output alive while the result is used: the graph it holds keeps the
    storages (and so their keys) from being freed and reused."""
    stack, found = [], {}
    own = {k for t in list(model.parameters()) + list(model.buffers()) for k, _ in _storages(t)}

    def pack(t):
        for key, nbytes in _storages(t):
            if key not in own and key not in found:
                found[key] = (stack[-1] if stack else model, t, nbytes)
        return t

    def enter(m, args):
        stack.append(m)

    def leave(m, args, out):
        stack.pop()  # returns None: the output stays as it is
    mods = list(model.modules()) if attribute else []
    hooks = [h for m in mods for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
    finally:
        for h in hooks:
            h.remove()
    return out, found


def saved_kind(name):
    """A module's name -> the kind its saved tensors are listed under: 'transformer.h.3.mlp.gate_up'
    -> 'mlp.gate_up'; a block's own ops (the residual adds; recompute's checkpoint keeps its input
    there) -> 'block'; GPT.forward's own ops -> 'loss'."""
    name = re.sub(r"^transformer\.", "", name)
    if re.fullmatch(r"h\.\d+", name):
        return "block"
    return re.sub(r"^h\.\d+\.", "", name) or "loss"


def _forward_loss(net, x, y):
    with torch.autocast(x.device.type, torch.bfloat16):  # the step's autocast, on the CPU too
        return net(x, y)[1]


SAVED_DTYPES = {torch.uint8: "u8_bytes", torch.bfloat16: "bf16_bytes", torch.float32: "fp32_bytes"}
SAVED_COUNTS = ("storages", "u8_bytes", "bf16_bytes", "fp32_bytes", "other_bytes")


def saved_by_kind(net, x, y):
    """Rows per (kind, module type): what one eager forward with its loss (BF16 autocast, as the
    step) saves for the backward, in bytes by dtype (uint8: FP4 codes, scales and clip masks), and
    a total row. Eager: a compiled graph chooses its own saved set (saved_totals)."""
    loss, found = count_saved(lambda: _forward_loss(net, x, y), net)
    names = {m: n for n, m in net.named_modules()}
    rows = {}
    for mod, t, nbytes in found.values():
        what = type(mod).__name__ + (f" {mod.recipe}" if hasattr(mod, "recipe") else "")
        row = rows.setdefault((saved_kind(names[mod]), what),
                              dict(kind=saved_kind(names[mod]), module=what, **dict.fromkeys(SAVED_COUNTS, 0)))
        row["storages"] += 1
        row[SAVED_DTYPES.get(t.dtype, "other_bytes")] += nbytes
    del loss
    rows = list(rows.values())
    total = dict(kind="total (eager)", module="", **{k: sum(r[k] for r in rows) for k in SAVED_COUNTS})
    for r in rows + [total]:
        r["bytes"] = sum(v for k, v in r.items() if k.endswith("_bytes"))
        r["mib"] = round(r["bytes"] / 2**20, 2)
        r["bytes_per_token"] = round(r["bytes"] / x.numel(), 1)
    return rows + [total]


def compiled_saved_bytes(net, compiled, x, y):
    """Bytes one forward of `compiled` (torch.compile(net), already compiled) saves for the
    backward: the graph's own choice, whole (no module attribution inside a compiled graph)."""
    loss, found = count_saved(lambda: _forward_loss(compiled, x, y), net, attribute=False)
    total = sum(nbytes for _, _, nbytes in found.values())
    del loss, found
    return total


def section_saved(args):
    """Per step row (--step-variants, --step-loss-chunk, --step-recompute; the optimizer does not
    matter): the bytes one eager forward saves for the backward, by kind of layer, and with
    --saved-compiled the compiled forward's total beside the eager one. On the CPU (e.g. --model
    tiny --seq 64 --batch 2) or the GPU."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    combos = step_combos(args.step_variants, args.step_optimizers, args.step_loss_chunk, args.step_recompute)
    rows = []
    for variant, chunk, recompute in dict.fromkeys((v, c, r) for v, _, c, r, _ in combos):
        head = dict(model=args.model, variant=variant, loss_chunk=chunk, recompute=recompute, tokens=args.batch * args.seq)
        try:
            net, cfg = _step_net(args, variant, chunk, recompute, device)
        except SkipVariant as why:
            rows.append(dict(head, skipped=str(why)))
            continue
        x, y = _step_batch(args, cfg, device)
        kinds = saved_by_kind(net, x, y)
        if args.saved_compiled:
            fwd = torch.compile(net)
            _forward_loss(fwd, x, y).backward()  # compiles forward and backward
            net.zero_grad(set_to_none=True)
            kinds[-1]["compiled_bytes"] = compiled_saved_bytes(net, fwd, x, y)
            torch._dynamo.reset()
        rows += [dict(head, **r) for r in kinds]
        del net
    print_table([r for r in rows if "kind" in r], ["variant", "loss_chunk", "recompute", "kind", "module", "storages", "u8_bytes",
                                                   "bf16_bytes", "fp32_bytes", "other_bytes", "bytes", "bytes_per_token",
                                                   "compiled_bytes"])
    return rows


# ---------------------------------------------------------------------------------------------
# step_profile: where a compiled training step's time goes, by kernel (torch.profiler)

# kernel families of a profile, by name (first match): what bench.py step_profile sums a step's
# GPU time into; "other" is the rest (copies, torch's elementwise and reduction kernels)
KERNEL_FAMILIES = (
    ("fp4 (kernels.cu)", r"\b(quant_rows|quant_cols|quant_rows_fold|nv_amax|fold_mx|rotate_back|dequant|adamw_nvfp4)\b"),
    ("fp4 attention (Triton)", r"^_(fwd|bwd_dq|bwd_dkdv|delta)_kernel"),
    ("GEMMs (cuBLAS, CUTLASS)", r"nvjet|gemm|cutlass|xmma|cublas"),
    ("attention (SDPA)", r"flash|fmha|cudnn|attention"),
    ("inductor (Triton)", r"^triton_"),
)


def kernel_family(name):
    for family, pattern in KERNEL_FAMILIES:
        if re.search(pattern, name):
            return family
    return "other"


def section_step_profile(args):
    """Per --step-variants row (as `step` takes them, at --model/--seq/--batch, --compile-mode):
    the step's wall time, the GPU's busy time (the kernels' summed device time: less than the wall
    time when the host cannot keep the GPU fed) and the kernels that take the most of it."""
    rows = []
    for variant, optimizer, chunk, recompute, acc in step_combos(args.step_variants, args.step_optimizers,
                                                                 args.step_loss_chunk, args.step_recompute, args.step_accum):
        net, opt, cfg = _step_model(args, variant, optimizer, chunk, recompute)
        step = _train_step(torch.compile(net, mode=args.compile_mode), opt, *_step_batch(args, cfg), acc)
        ms = bench(step, warmup=3, reps=args.step_reps)
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.self_device_time_total for e in events) / 2e3  # ms a step
        top = sorted(events, key=lambda e: -e.self_device_time_total)[:8]
        families = {}
        for e in events:
            f = kernel_family(e.key)
            families[f] = families.get(f, 0.0) + e.self_device_time_total / 2e3
        row = dict(model=args.model, variant=variant, optimizer=optimizer, loss_chunk=chunk, recompute=recompute,
                   accumulation=acc, compile_mode=args.compile_mode, ms=round(ms, 1), gpu_busy_ms=round(busy, 2),
                   busy_share=round(busy / ms, 3), tokens_per_s=round(args.batch * args.seq * acc / ms * 1e3),
                   family_ms={f: round(v, 2) for f, v in sorted(families.items(), key=lambda kv: -kv[1])},
                   top_kernels=[dict(name=e.key[:90], ms=round(e.self_device_time_total / 2e3, 2),
                                     calls=e.count // 2) for e in top])
        rows.append(row)
        print(f"  {variant} {optimizer}: {ms:.1f} ms a step, GPU busy {busy:.1f} ms ({100 * busy / ms:.0f}%); "
              + ", ".join(f"{f} {v}" for f, v in row["family_ms"].items()))
        for k in row["top_kernels"]:
            print(f"      {k['ms']:8.2f} ms  x{k['calls']:<4} {k['name']}")
        del net, opt, step
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------
# fsdp (not in the default sections): train.py's 1B run under DDP against FSDP2, through torchrun

def _random_corpus(path, vocab=100277, n=1 << 22):
    """Random token ids: the speed of a step does not depend on the text (loss ~ ln vocab)."""
    os.makedirs(path, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        torch.randint(0, vocab, (n,), generator=gen, dtype=torch.int32).numpy().tofile(os.path.join(path, f"{split}.bin"))
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(dict(vocab_size=vocab, eot_token=0, dtype="uint32", encoding="random"), f)


def _train_run(n, fsdp, recipe, args, data_dir):
    """One torchrun of train.py config/llama_1b.py on n GPUs, one micro-batch per rank a step;
    returns its summary.json (rank 0's peak memory; tokens/s over all ranks) or the error."""
    out_dir = os.path.join("out", "bench_fsdp", f"{recipe}_{'fsdp' if fsdp else 'ddp'}_{n}")
    cmd = ["torchrun", "--standalone", f"--nproc_per_node={n}", "train.py", "config/llama_1b.py",
           f"--fsdp={fsdp}", f"--recipe={recipe}", f"--max_iters={args.fsdp_iters}",
           f"--gradient_accumulation_steps={n}", "--eval_iters=1", "--always_save_checkpoint=False",
           f"--compile={args.fsdp_compile}", f"--data_dir={data_dir}", f"--out_dir={out_dir}"]
    print(" ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        return dict(error=(p.stdout + p.stderr)[-2000:])
    with open(os.path.join(out_dir, "summary.json")) as f:
        return json.load(f)


def section_fsdp(args):
    """Tokens/s per GPU and peak memory per GPU (rank 0's) of the 1B model, DDP against FSDP2, on
    each GPU count in --gpus (1: one process against FSDP2 on one rank, a check of the CUDA path);
    the first timed step is excluded (compile) as train.py does."""
    data_dir = os.path.join("out", "bench_fsdp", "data")
    _random_corpus(data_dir)
    rows = []
    for n in map(int, args.gpus.split(",")):
        if n > torch.cuda.device_count():
            rows.append(dict(gpus=n, skipped=f"{torch.cuda.device_count()} GPUs here"))
            continue
        for recipe, fsdp in [(r, f) for r in args.fsdp_recipe.split(",") for f in (False, True)]:
            s = _train_run(n, fsdp, recipe, args, data_dir)
            row = dict(model="1b", recipe=recipe, gpus=n, mode="fsdp2" if fsdp else "ddp" if n > 1 else "single")
            if "error" in s:
                print(s["error"])
                rows.append(dict(row, error=s["error"]))
                continue
            train_loss = s["loss_curve"]["train_loss"]
            rows.append(dict(row, tokens_per_s_per_gpu=round(s["tokens_per_s"] / n),
                             peak_gib_per_gpu=round(s["peak_mem_gib"], 2), wall_s=round(s["wall_s"]),
                             first_loss=round(train_loss[0], 4), last_loss=round(train_loss[-1], 4)))
    print_table([r for r in rows if "tokens_per_s_per_gpu" in r],
                ["model", "recipe", "gpus", "mode", "tokens_per_s_per_gpu", "peak_gib_per_gpu", "first_loss", "last_loss", "wall_s"])
    return rows


SECTIONS = {"step": section_step, "step_profile": section_step_profile, "saved": section_saved}
SECTIONS_MULTI_GPU = {"fsdp": section_fsdp}
