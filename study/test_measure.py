"""
Tests for measure.py on a CPU: the inputs each section builds (spectra, momentum from a checkpoint),
the rows of ns and lora_rank at tiny sizes, the state-format errors, and where the rows are written.
Seconds in all; the full sections are docs/fullstack.md's commands.

$ python -m pytest study/test_measure.py -q
"""
import json
import os
from types import SimpleNamespace

import pytest
import torch

import bench_io
import bench_ops
import measure

LORA = dict(synthetic="128x128", ranks="16", calls=1, tokens=128, backward=False, backward_rank=0, ckpt=None,
            device="cpu")


# ---------------------------------------------------------------------------------------------
# ns

def test_power_law_matrix_has_the_asked_spectrum():
    """U diag(i^-alpha) V^T with orthonormal U, V: its singular values are i^-alpha (FP64)."""
    for shape in ((64, 160), (160, 64)):
        s = torch.linalg.svdvals(measure.power_law_matrix(shape, 1.5))
        want = torch.arange(1, 65, dtype=torch.float64) ** -1.5
        assert (s - want).abs().max() < 1e-12, (shape, (s - want).abs().max())


@pytest.mark.parametrize("split", [False, True])
def test_momentum_matrices_takes_a_middle_layer(tmp_path, split):
    """One 2-D momentum buffer per shape, the middle one of the layers that have it (index n // 2);
    1-D buffers and AdamW states are not Muon's; a split optimizer ('parts') is searched whole."""
    bufs = [torch.full((4, 8), float(i)) for i in range(3)] + [torch.full((8, 2), 9.0)]
    state = {i: {"momentum_buffer": b} for i, b in enumerate(bufs)}
    state.update({7: {"momentum_buffer": torch.ones(5)}, 8: {"exp_avg": torch.ones(3, 3)}})
    sd = dict(state=state)
    if split:
        sd = dict(parts=[dict(state={k: v for k, v in state.items() if k < 2}),
                         dict(state={k: v for k, v in state.items() if k >= 2})])
    torch.save(dict(optimizer=sd), tmp_path / "ckpt.pt")
    got = measure.momentum_matrices(str(tmp_path / "ckpt.pt"))
    assert set(got) == {(4, 8), (8, 2)}
    assert torch.equal(got[(4, 8)], bufs[1]) and torch.equal(got[(8, 2)], bufs[3])


def test_section_ns_rows_at_tiny_shapes():
    """Every (shape, source) gets one row per NS_PRECISIONS entry; bf16 is its own reference;
    FP32 and BF16 run no NVFP4 GEMM, the NVFP4 designs do. docs/fullstack.md's finding (at 30m and 1b)
    holds at these shapes too: compensated_tail near BF16's cosine (measured within 0.004, 0.01 on
    the square 128x128 Gaussian; bound 0.02), the naive cast far below it on every Gaussian
    matrix (measured 0.78-0.86 below; bound 0.3)."""
    rows = measure.section_ns(SimpleNamespace(ns_sizes="tiny", momentum=[]))
    shapes = bench_ops.ns_shapes("tiny")
    assert len(rows) == len(shapes) * 2 * len(measure.NS_PRECISIONS)
    for r in rows:
        if r["precision"] == "bf16":
            assert r["d_cos_vs_bf16"] == 0
        assert (r["fp4_share"] > 0) == (r["precision"] == "nvfp4"), r
        if r["design"] == "compensated_tail":
            assert abs(r["d_cos_vs_bf16"]) < 0.02, r
        if r["design"] == "naive" and r["source"] == "gauss":
            assert r["d_cos_vs_bf16"] < -0.3, r


def test_section_ns_uneven_rows(monkeypatch):
    """One row per design and input (log-uniform rows and columns, 5% at 1000:1); the spreads it
    reports are the input's; the projected cost is the FLOP count's: diagonal_tail does
    44 m^2 n + 18 m^3 NVFP4 FLOPs against BF16's 20 m^2 n + 10 m^3 (62 / 4 / 30 for a square)."""
    monkeypatch.setattr(measure, "ns_shapes", lambda size: {"o": (64, 64)})
    args = SimpleNamespace(ns_sizes="tiny", momentum=[], uneven_spreads="1000", uneven_seeds="0")
    rows = measure.section_ns_uneven(args)
    assert len(rows) == 4 * len(measure.NS_UNEVEN_DESIGNS)
    for r in rows:
        along = "row_spread" if r["source"].startswith("rows") else "col_spread"
        assert 500 < r[along] < 2000, r  # 1000:1 times the Gaussian rows' own spread
        assert (r["fp4_share"] > 0) == (r["precision"] == "nvfp4"), r
        if r["design"] == "diagonal_tail":
            assert r["cost_vs_bf16"] == round(62 / 4 / 30, 3), r
            if "log-uniform" in r["source"]:  # the bound's inputs (test_newton_schulz.py tests it)
                assert abs(r["d_cos_vs_bf16"]) < 0.005, r


# ---------------------------------------------------------------------------------------------
# states

def test_sqrt_state_keeps_the_small_v():
    """SPEC 8.1's reason for quantizing sqrt(v): NVFP4 of v itself rebuilds most small v > 0 as 0
    on heavy-tailed moments (measured 79%), the default sqrt format under 1% (measured 0.8%)."""
    sets = measure._heavy_moments()
    direct = measure._v_direct_errors(sets)
    default = measure._format_errors(sets, measure.STATE_FORMATS[0])
    assert direct["v_zeroed"] > 0.5 and default["v_zeroed"] < 0.02, (direct, default)
    assert 0 < default["update_rel_mse"] < 0.2, default


def test_ema_off_stochastic_rounding_tracks_m():
    """Round to nearest stalls an EMA that moves less than half a grid step a step (m through a
    sign flip): more elements end > 20% off than with SR (measured 0.37 against 0.19)."""
    sr, rn = measure.STATE_FORMATS[0], measure.STATE_FORMATS[1]
    assert sr[2][0] == "sr" and rn[2][0] == "rn"
    assert measure._ema_off("signed", rn) > 1.5 * measure._ema_off("signed", sr)


# ---------------------------------------------------------------------------------------------
# lora_rank

def test_lora_rank_rows():
    """quartet2 and fullstack without L are the same linear (identical rows); rank 16 cuts the
    output and dgrad errors as 1 - sqrt(1 - e_r) predicts (docs/fullstack.md: within 0.4 points at 640x640;
    measured here within 0.8 at 128x128, bound 2), and e_r is the spectrum's own top-16 share."""
    rows = {(r["weights"], r["variant"]): r for r in measure.section_lora_rank(SimpleNamespace(**LORA))}
    assert len(rows) == 2 * len(measure.rank_variants([16]))
    for alpha in (0.5, 1.0):
        group = f"128x128 s_i=(1+i)^-{alpha}"
        base, r16 = rows[group, "fullstack r=none"], rows[group, "fullstack r=16"]
        assert {k: base[k] for k in ("out", "dgrad", "wgrad")} == \
            {k: rows[group, "quartet2"][k] for k in ("out", "dgrad", "wgrad")}
        s2 = (1 + torch.arange(128, dtype=torch.float64)) ** (-2 * alpha)
        assert abs(r16["top_r_energy"] - float(s2[:16].sum() / s2.sum())) < 1e-5
        for k in ("out", "dgrad"):
            assert r16[f"{k}_cut_pct"] > 20 and abs(r16[f"{k}_cut_pct"] - r16["predicted_cut_pct"]) < 2, r16



def test_held_lora_rows_tell_a_stale_L_from_a_refit(tmp_path):
    """A fullstack run whose L was fitted once, at step 0, to the init: after 10 steps at lr 0.01
    the L it holds leaves more of W outside it than a refit does (Eckart-Young), and cuts the
    output error by less. Measured: held residual 0.972, refit 0.725; output cut 2.8% held, 26.3%
    refitted (at 40 steps 0.990, 0.718; 1.0%, 27.7%): 10 steps separate them as widely as 40, at a
    quarter of the training. With the checkpoint's L replaced by the refit measure.layer makes (the
    same randomized SVD, the same seed), "as held" is that refit exactly."""
    import lora
    import train
    from test_train import write_corpus
    write_corpus(str(tmp_path))
    out = tmp_path / "out"
    train.main([f"--data_dir={tmp_path}", f"--out_dir={out}", "--model_size=tiny", "--block_size=32",
                "--batch_size=8", "--eval_iters=1", "--eval_interval=10", "--max_iters=10", "--learning_rate=0.01",
                "--device=cpu", "--dtype=float32", "--compile=False", "--recipe=fullstack", "--sample_tokens=0"])
    path = str(out / "ckpt.pt")
    layers, it = measure.from_checkpoint(path, 128)
    rows = {r["variant"]: r for r in measure.held_lora_rows(path, layers, it, 1)}
    none, held, fresh = (rows[f"fullstack{v}"] for v in (" r=none", ", L as held", ", L refitted"))
    assert none["residual"] == 1 and fresh["residual"] < held["residual"] < 1, rows
    assert fresh["out_cut_pct"] > held["out_cut_pct"] + 5, (held, fresh)
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    for w, _, _ in layers:  # the refit measure.layer would make, written into the checkpoint
        name = next(k[:-len(".weight")] for k, v in ckpt["model"].items() if k.endswith(".weight") and v is not None
                    and v.shape == w.shape and torch.equal(v.float(), w))
        u, s, v = lora.randomized_svd(w, ckpt["model"][name + ".lora_us"].shape[1], seed=0)
        ckpt["model"][name + ".lora_us"].copy_(u * s)
        ckpt["model"][name + ".lora_v"].copy_(v)
    torch.save(ckpt, path)
    rows = {r["variant"]: r for r in measure.held_lora_rows(path, layers, it, 1)}
    assert {k: rows["fullstack, L as held"][k] for k in ("out", "dgrad", "residual")} == \
        {k: rows["fullstack, L refitted"][k] for k in ("out", "dgrad", "residual")}
    with pytest.raises(ValueError, match="block linear 0's L is"):
        measure.held_lora_rows(path, layers[1:], it, 1)

# ---------------------------------------------------------------------------------------------
# the command line

def test_out_path_keeps_the_result_file_names():
    """results/<gpu>/bench_ns.json, bench_states.json as bench.py wrote them; --out a folder or,
    for one section, the .json file itself (as lora_rank.py's --out was)."""
    args = measure.parse(["--sections", "ns,states,lora_rank"])
    assert measure.out_path(args, "ns") == os.path.join("results", bench_io.gpu_slug(), "bench_ns.json")
    assert measure.out_path(measure.parse(["--sections", "states", "--out", "d"]), "states") == os.path.join(
        "d", "bench_states.json")
    assert measure.out_path(measure.parse(["--sections", "lora_rank", "--out", "d/x.json"]), "lora_rank") == "d/x.json"
    with pytest.raises(SystemExit):
        measure.parse(["--sections", "ns,states", "--out", "x.json"])
    with pytest.raises(SystemExit):
        measure.parse(["--sections", "ns_time"])


def test_main_writes_meta_and_rows(tmp_path):
    measure.main(["--sections", "lora_rank", "--out", str(tmp_path)] +
                 [f"--{k.replace('_', '-')}={v}" for k, v in LORA.items() if k in ("synthetic", "ranks", "calls", "tokens")])
    saved = json.load(open(tmp_path / "lora_rank.json"))
    assert {"gpu", "torch", "code", "kernel_compiler"} <= set(saved["meta"]) and saved["meta"]["args"]["ranks"] == "16"
    assert len(saved["rows"]) == 2 * len(measure.rank_variants([16]))


# ---------------------------------------------------------------------------------------------
# root_states

def test_momentum_replay_tells_the_formats_apart():
    """What muon.ROOT_STATES rests on, at a small shape (128x256, 40 steps, noise 3; seed 0).
    One NVFP4 term: each step adds NVFP4's ~10% relative error, the EMA keeps ~1/(1 - beta^2) = 10
    steps of it, so |m - exact| ~ 0.1 sqrt(10) = 0.32 |m| (measured 0.34); Newton-Schulz lifts that
    noise's directions to singular values ~1 (update cosine measured 0.87). Two terms: ~1% a step,
    ~3% in m (measured 0.022), cosine 0.999. Bounds between the two, with room for the draw."""
    got = measure.momentum_replay((128, 256), 3.0, 40)
    (c_fp32, e_fp32), (c_one, e_one), (c_two, e_two) = (got[(s, "bf16")] for s in ("fp32", "nvfp4", "nvfp4x2"))
    print({k: (round(c, 4), round(e, 4)) for k, (c, e) in got.items()})
    assert abs(c_fp32 - 1) < 1e-5 and e_fp32 == 0.0  # the reference against itself (FP32 dot products)
    assert e_one > 0.2 and c_one < 0.95
    assert e_two < 0.05 and c_two > 0.99
    assert got[("nvfp4x2", "nvfp4")][0] > 0.97  # with NVFP4 Newton-Schulz on top (measured 0.984)
    assert got[("bf16", "bf16")][1] < 0.01  # BF16: 2^-9 a step, ~0.4% in m (measured 0.0042)


def test_root_states_rows(tmp_path):
    rows = measure.section_root_states(SimpleNamespace(root_shapes="64x128", root_steps=6, root_lm=0,
                                                       root_lm_seeds="0", root_lm_rows=""))
    assert len(rows) == 2 * len(measure.ROOT_STATE_ROWS)
    assert {(r["state"], r["ns"]) for r in rows} == set(measure.ROOT_STATE_ROWS)
    assert all(set(r) == {"shape", "noise", "state", "ns", "update_cos", "momentum_rel_err"} for r in rows)


def test_root_states_lm_sets_the_momentum_alone(monkeypatch):
    """--root-lm trains the tiny LM with ROOT's momentum in a state/ns row's format and the AdamW
    part as in plain root (torch's, FP32): build(states=) would have put that part in NVFP4 too, a
    second change on a model 40% embeddings (the first numbers of docs/fullstack.md's table were made
    so). A row named by build() (root_fp4) runs that optimizer as it stands."""
    import optim
    seen = []

    def fake_get(split, key, b=4):
        g = torch.Generator().manual_seed(sum(key) if isinstance(key, list) else 0)
        x = torch.randint(0, 2048, (b, 65), generator=g)
        return x[:, :-1], x[:, 1:]

    def run(get, steps, seed, lr, make_opt=None, **kw):
        net, opt, val = real(get, 2, seed, lr, make_opt=make_opt, **kw)
        seen.append(opt)
        return net, opt, val
    real = measure._tiny_lm_run
    monkeypatch.setattr(measure, "_lm_batches", lambda: fake_get)
    monkeypatch.setattr(measure, "_tiny_lm_run", run)
    rows = measure.section_root_states(SimpleNamespace(root_shapes="", root_steps=0, root_lm=2, root_lm_seeds="0",
                                                       root_lm_rows="nvfp4x2/bf16,root_fp4"))
    assert [(r["optimizer"], r["state"], r["ns"], len(r["lm_val"])) for r in rows] == [
        ("root", "nvfp4x2", "bf16", 1), ("root_fp4", "bf16", "nvfp4", 1)]
    root, adamw = seen[0].parts
    assert isinstance(adamw, torch.optim.AdamW) and not isinstance(adamw, optim.AdamW)
    assert root.defaults["state"] == "nvfp4x2"
    assert all("momentum_residual" in st for st in root.state.values())
    root, adamw = seen[1].parts  # a build() name as it stands: root_fp4's AdamW part in NVFP4
    assert isinstance(adamw, optim.AdamW) and adamw.defaults["state"] == "nvfp4"


def test_regression_reaches_fp32_loss():
    """regression_loss (least squares, inputs with log-normal channel scales, minibatch AdamW
    with a cosine lr): NVFP4 states end within 25% of FP32 AdamW's loss (measured 1.12x for the
    default format; SPEC's Hadamard-128 + mean + SR format ends ~15x above, printed)."""
    fp32 = measure.regression_loss(0)
    nvfp4 = measure.regression_loss(0, state="nvfp4")
    spec = measure.regression_loss(0, state="nvfp4", hadamard=128, mean="block", rounding="sr")
    print(f"\nregression loss: fp32 {fp32:.4e}, nvfp4 {nvfp4:.4e} ({nvfp4 / fp32:.3f}x), "
          f"SPEC H128 + mean + SR {spec:.4e} ({spec / fp32:.2f}x)")
    assert fp32 < 1.3e-4  # near the noise floor: the problem is solved
    assert nvfp4 < 1.25 * fp32
