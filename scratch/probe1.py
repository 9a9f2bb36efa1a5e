import cProfile, pstats, io, time, statistics, torch, fp4, bench
torch.backends.cuda.matmul.allow_tf32 = False
m = 16384
print("== A: GEMM ceiling (ms), 3 GEMMs per shape")
tot = {"bf16": 0, "fp8": 0, "fp8fast": 0}
for k, n in bench.LINEAR_SHAPES:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    e = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    f8 = lambda t: (t.float().clamp(-6, 6)).to(torch.float8_e4m3fn)
    x8, w8, e8 = f8(x), f8(w), f8(e)
    wT8, eT8, xT8 = w8.t().contiguous(), e8.t().contiguous(), x8.t().contiguous()
    s = lambda r: torch.ones(r, 1, device="cuda")
    def fp8(fast):
        torch._scaled_mm(x8, w8.t(), scale_a=s(m), scale_b=s(n).t(), out_dtype=torch.bfloat16, use_fast_accum=fast)
        torch._scaled_mm(e8, wT8.t(), scale_a=s(m), scale_b=s(k).t(), out_dtype=torch.bfloat16, use_fast_accum=fast)
        torch._scaled_mm(eT8, xT8.t(), scale_a=s(n), scale_b=s(k).t(), out_dtype=torch.bfloat16, use_fast_accum=fast)
    r = dict(bf16=bench.bench(lambda: (x @ w.t(), e @ w, e.t() @ x)),
             fp8=bench.bench(lambda: fp8(False)), fp8fast=bench.bench(lambda: fp8(True)))
    for key in tot: tot[key] += r[key]
    print(k, n, {a: round(b, 3) for a, b in r.items()})
print("sum", {a: round(b, 3) for a, b in tot.items()}, "ratios", round(tot["bf16"] / tot["fp8"], 3), round(tot["bf16"] / tot["fp8fast"], 3))

print("== B: device-time profile, quartet")
for k, n in [(2048, 6144), (2048, 2048)]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    lin = fp4.FP4Linear(k, n, device="cuda", dtype=torch.bfloat16)
    run = bench._fwd_bwd(lin, x, g)
    wall = bench.bench(run)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run(); torch.cuda.synchronize()
    evs = [ev for ev in prof.key_averages()]
    evs.sort(key=lambda ev: -ev.self_device_time_total)
    total = sum(ev.self_device_time_total for ev in evs) / 1000
    print(f"-- {m}x{k}->{n}: wall {wall:.3f} ms, device busy {total:.3f} ms")
    for ev in evs[:22]:
        print(f"  {ev.self_device_time_total/1000:8.3f} ms  x{ev.count:3d}  {ev.key[:110]}")

print("== C: host profile, quartet fwd+bwd at 256^3")
xs = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
lin = fp4.FP4Linear(256, 256, device="cuda", dtype=torch.bfloat16)
for _ in range(5): lin(xs).sum().backward()
torch.cuda.synchronize()
pr = cProfile.Profile(); pr.enable()
for _ in range(100): lin(xs).sum().backward()
pr.disable(); torch.cuda.synchronize()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(40); print(s.getvalue()[:9000])
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(30); print(s.getvalue()[:7000])
