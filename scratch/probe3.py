import cProfile, pstats, io, torch, fp4, bench
xs = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
lin = fp4.FP4Linear(256, 256, device="cuda", dtype=torch.bfloat16)
for _ in range(5): lin(xs).sum().backward()
torch.cuda.synchronize()
pr = cProfile.Profile(); pr.enable()
for _ in range(200): lin(xs).sum().backward()
pr.disable(); torch.cuda.synchronize()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(45); print(s.getvalue()[:8000])
m = 16384
for k, n in [(2048, 6144), (2048, 2048)]:
    for recipe in ("bf16", "quartet"):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        lin = fp4.FP4Linear(k, n, recipe=recipe, device="cuda", dtype=torch.bfloat16)
        eager = bench.bench(bench._fwd_bwd(lin, x, g))
        try:
            gl = torch.cuda.make_graphed_callables(lin, (x,))
            graphed = bench.bench(bench._fwd_bwd(gl, x, g))
        except Exception as err:
            graphed = f"failed: {type(err).__name__}: {str(err)[:300]}"
        print(f"{m}x{k}->{n} {recipe}: eager {eager:.3f} ms, graphed {graphed}")
