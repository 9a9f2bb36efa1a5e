import torch, fp4, bench
m = 16384
for k, n in bench.LINEAR_SHAPES:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    lin = fp4.FP4Linear(k, n, device="cuda", dtype=torch.bfloat16)
    run = bench._fwd_bwd(lin, x, g)
    wall = bench.bench(run)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run(); torch.cuda.synchronize()
    evs = sorted(prof.key_averages(), key=lambda ev: -ev.self_device_time_total)
    total = sum(ev.self_device_time_total for ev in evs) / 1000
    print(f"-- {m}x{k}->{n}: wall {wall:.3f} ms, device busy {total:.3f} ms")
    for ev in evs[:12]:
        print(f"  {ev.self_device_time_total/1000:8.3f} ms  x{ev.count:3d}  {ev.key[:100]}")
