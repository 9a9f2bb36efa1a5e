"""
Tests for analysis.py and law.py: the paired intervals and the law fit on synthetic losses with known
answers, and the report's pairing and tables on synthetic run records (written as study.py
writes them). CPU only, a few seconds.

$ python -m pytest study/test_analysis.py -q
"""

import json
import math

import numpy as np
import pytest

import analysis
import law
import records
import study

# -----------------------------------------------------------------------------
# paired intervals

def test_t_quantile_textbook_values():
    # two-sided 95% (and one 99%) critical values of Student's t, from any printed table
    table = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 5: 2.5706, 10: 2.2281, 30: 2.0423}
    for df, t in table.items():
        assert analysis.t_quantile(0.975, df) == pytest.approx(t, abs=1e-4), df
    assert analysis.t_quantile(0.995, 4) == pytest.approx(4.6041, abs=1e-4)
    z = 1.959963984540054  # large df: the normal's quantile + (z^3 + z) / (4 df) (Cornish-Fisher)
    assert analysis.t_quantile(0.975, 20000) == pytest.approx(z + (z ** 3 + z) / 80000, abs=1e-7)
    for df in (1, 2, 7, 8):  # the CDF is exact: it inverts the quantile
        assert analysis.t_two_sided(analysis.t_quantile(0.9, df), df) == pytest.approx(0.8, abs=1e-12)
    with pytest.raises(ValueError, match='0.5 < p < 1'):
        analysis.t_quantile(0.2, 3)

def test_paired_gap_arithmetic():
    ref = {0: 3.0, 1: 3.1, 2: 2.9}
    other = {s: ref[s] * (1 + g) for s, g in zip(ref, (0.01, 0.02, 0.03))}
    other[7] = 9.9  # a seed bf16 lacks: not a pair, ignored
    gap = analysis.paired_gap(ref, other)
    assert gap['n'] == 3 and gap['seeds'] == [0, 1, 2]
    half = 4.302652729911275 * 0.01 / math.sqrt(3)  # t(0.975, 2) * sd / sqrt(n)
    assert gap['rel'] == pytest.approx(0.02, abs=1e-12)
    assert gap['rel_lo'] == pytest.approx(0.02 - half, abs=1e-9)
    assert gap['rel_hi'] == pytest.approx(0.02 + half, abs=1e-9)
    nats = [other[s] - ref[s] for s in ref]  # 0.03, 0.062, 0.087
    assert gap['nats'] == pytest.approx(np.mean(nats), abs=1e-12)
    assert gap['nats_hi'] - gap['nats'] == pytest.approx(
        4.302652729911275 * np.std(nats, ddof=1) / math.sqrt(3), abs=1e-9)
    one = analysis.paired_gap({0: 3.0}, {0: 3.03})
    assert one['rel'] == pytest.approx(0.01) and math.isnan(one['rel_lo'])

def test_paired_interval_covers_the_known_gap():
    """2000 synthetic 3-seed studies: a seed effect shared by both recipes (sd 0.05 nats, ten
    times the recipe's own noise) and a true gap of 1.5%. The t-interval on paired gaps
    is exact for normal noise: coverage 0.95 +- 3 sd of a binomial mean (0.0049)."""
    rng = np.random.default_rng(0)
    trials, covered, widths = 2000, 0, []
    for _ in range(trials):
        base = 3.0 + rng.normal(0, 0.05, size=3)
        ref = dict(enumerate(base))
        other = dict(enumerate(base * (1 + 0.015 + rng.normal(0, 0.004, size=3))))
        g = analysis.paired_gap(ref, other)
        covered += g['rel_lo'] <= 0.015 <= g['rel_hi']
        widths.append(g['rel_hi'] - g['rel_lo'])
    assert abs(covered / trials - 0.95) < 3 * math.sqrt(0.95 * 0.05 / trials)
    # the width follows the recipe noise (0.004), not the seed effect (0.05 / 3 = 0.017):
    # E[s] = 0.886 sigma for n = 3, so the mean width is 2 * 4.303 * 0.886 * 0.004 / sqrt(3)
    assert np.mean(widths) == pytest.approx(2 * 4.3027 * 0.8862 * 0.004 / math.sqrt(3), rel=0.05)

# -----------------------------------------------------------------------------
# the law fit

TRUE = dict(A=9e4, a=0.5785, B=3e5, b=0.5389, g=0.2764, E=1.6)  # Quartet's exponents
EFF = {'bf16': (1.0, 1.0), 'quartet': (0.66, 0.82), 'nvfp4': (0.8, 0.5)}

def synthetic_cells(params, sizes, budgets, noise=0.0, seeds=(0,), rng=None):
    """{(group, N, D): {seed: loss}} from the law itself, plus per-run Gaussian noise."""
    out = {}
    for g, (en, ed) in EFF.items():
        for N in sizes:
            for D in budgets:
                L = float(law.law_loss(N, D, params, en, ed))
                out[(g, N, D)] = {s: L + (rng.normal(0, noise) if noise else 0.0) for s in seeds}
    return out

def means(seed_losses):
    return [(g, N, D, float(np.mean(list(v.values())))) for (g, N, D), v in seed_losses.items()]

def test_law_fit_recovers_known_parameters():
    cells = means(synthetic_cells(TRUE, [30e6, 50e6, 100e6], [25e6, 50e6]))
    fit = law.fit_law(cells, exponents='quartet')
    for k in ('A', 'B', 'E'):
        assert fit['params'][k] == pytest.approx(TRUE[k], rel=1e-6), k
    for g in ('quartet', 'nvfp4'):
        assert fit['eff'][g] == pytest.approx(EFF[g], rel=1e-6), g
    assert fit['rms'] < 1e-9 and fit['dof'] == 18 - 7 and fit['problems'] == []
    # 3 sizes x 2 budgets cannot pin the exponents: auto keeps Quartet's and says so
    auto = law.fit_auto(cells)
    assert auto['exponents'] == 'quartet' and 'cannot pin' in auto['note']
    # 3 x 3 with noise: the free fit is tried, and where its exponents are not pinned the note
    # gives them with their errors (what the data say, beside the fixed fit used)
    rng = np.random.default_rng(0)
    noisy = [(g, N, D, L + rng.normal(0, 0.05)) for g, N, D, L in
             means(synthetic_cells(TRUE, [30e6, 50e6, 100e6], [13e6, 25e6, 50e6]))]
    auto = law.fit_auto(noisy)
    assert auto['exponents'] == 'quartet' and 'that fit: a = ' in auto['note'] and ' ± ' in auto['note'], auto['note']

def test_law_fit_free_exponents():
    """Exponents unlike Quartet's, on 4 sizes x 4 budgets: auto frees and recovers them."""
    true = dict(TRUE, a=0.5, b=0.62, g=0.3, A=2e4, B=4e5)
    cells = means(synthetic_cells(true, [30e6, 50e6, 100e6, 200e6], [12e6, 25e6, 50e6, 100e6]))
    fit = law.fit_auto(cells)
    assert fit['exponents'] == 'free' and 'fitted' in fit['note']
    for k in ('a', 'b', 'g', 'E'):
        assert fit['params'][k] == pytest.approx(true[k], rel=1e-4), k
    assert fit['eff']['quartet'] == pytest.approx(EFF['quartet'], rel=1e-4)
    with pytest.raises(ValueError, match='reference recipe'):
        law.fit_law([c for c in cells if c[0] != 'bf16'])

def test_free_fit_escapes_a_start_where_one_term_is_gone():
    """Exponents far from Quartet's (b 1.46, g 0.63: the loss falls fast with D, as this study's
    short runs do) on 3 sizes x 3 budgets. With Quartet's exponents fixed, the fit drops the N term
    (A = 0), and a free fit started there cannot bring it back (its gradient is zero); fit_free's
    other starts do: the truth, to 1e-3."""
    true = dict(A=11439.0, a=0.628, B=1.0655e11, b=1.4596, g=0.6333, E=1.3651)
    cells = means(synthetic_cells(true, [30.5e6, 49.6e6, 102.8e6], [13e6, 50e6, 100e6]))
    fixed = law.fit_law(cells, exponents='quartet')
    assert fixed['problems'], fixed['params']  # the degenerate start, as on the H200's runs
    t = fixed['theta']
    stuck = law.fit_law(cells, exponents='free', start=np.concatenate(
        [t[:3], np.log([law.QUARTET_LAW[n] for n in 'abg']), t[3:]]))
    assert stuck['problems'] or stuck['rms'] > 1e-3  # what fit_auto did before fit_free
    fit = law.fit_auto(cells)
    assert fit['exponents'] == 'free' and fit['problems'] == [] and fit['rms'] < 1e-6
    for k in ('a', 'b', 'g', 'E'):
        assert fit['params'][k] == pytest.approx(true[k], rel=1e-3), k
    assert fit['eff']['quartet'] == pytest.approx(EFF['quartet'], rel=1e-3)

def test_law_fit_with_seed_noise():
    """Noise of 0.003 nats a run, 3 seeds: effN, effD within 4 standard errors of the truth
    (the fit's own, from the Jacobian), and the bootstrap interval over seeds around the fit."""
    rng = np.random.default_rng(1)
    seed_losses = synthetic_cells(TRUE, [30e6, 50e6, 100e6], [25e6, 50e6], 0.003, (0, 1, 2), rng)
    fit = law.fit_law(means(seed_losses))
    boot = law.bootstrap_eff(seed_losses, 'bf16', 'quartet', fit['theta'], n_boot=40)
    for g in ('quartet', 'nvfp4'):
        for j in (0, 1):
            est, se, truth = fit['eff'][g][j], fit['eff_se'][g][j], EFF[g][j]
            assert 0 < se < 0.2 and abs(est - truth) < 4 * se, (g, j, est, se)
            lo, hi = boot[g][j]
            assert lo < hi and lo <= est * 1.02 and est <= hi * 1.02, (g, j, lo, est, hi)

def test_bootstrap_draws_the_noise_of_one_seed_cells():
    """Every cell one seed, with relative noise 0.2% a run. Drawn with noise_rel = 0.2%, the
    bootstrap's 95% width of each log factor matches the spread of fits on 40 fresh noisy datasets
    (3.92 sd): the ratio within [0.55, 1.6] (100 draws give the width to ~15%, 40 datasets the sd
    to ~11%; the bounds are about 3 of their combined errors). Without noise_rel, nothing varies."""
    sigma, sizes, budgets = 0.002, [30e6, 50e6, 100e6], [25e6, 50e6, 100e6]
    exact = synthetic_cells(TRUE, sizes, budgets)
    def noisy(rng):
        return {k: {0: v[0] * (1 + rng.normal(0, sigma))} for k, v in exact.items()}
    start = law.fit_law(means(exact))['theta']
    fits = [law.fit_law(means(noisy(np.random.default_rng(100 + i))), start=start)['eff'] for i in range(40)]
    one = noisy(np.random.default_rng(7))
    fit = law.fit_law(means(one), start=start)
    assert law.bootstrap_eff(one, 'bf16', 'quartet', fit['theta'], n_boot=5) == {}
    boot = law.bootstrap_eff(one, 'bf16', 'quartet', fit['theta'], n_boot=100, noise_rel=sigma)
    for g in ('quartet', 'nvfp4'):
        for j in (0, 1):
            lo, hi = boot[g][j]
            spread = 3.92 * np.std([math.log(f[g][j]) for f in fits], ddof=1)
            assert 0.55 < math.log(hi / lo) / spread < 1.6, (g, j, lo, hi, spread)
    noise, cells = law.pooled_seed_sd({('a', 1, 1): {0: 1.0, 1: 1.02, 2: 0.98}, ('b', 1, 1): {0: 2.0}})
    assert cells == 1 and noise == pytest.approx(0.02)  # sd of (0, +2%, -2%) about the mean, ddof 1


def test_law_fit_says_when_the_form_does_not_describe_the_runs():
    """Losses that fall steeply with D and not at all with N (as bf16's did here at 0.1-1.6
    tokens/param: 4.01 -> 2.26 from 13M to 50M tokens, 1-4% across sizes): Quartet's exponents
    (b g = 0.149) cannot follow a 44% fall over 3.8x the data with E >= 0, so the fit puts E
    below zero and drops the N term, and says both."""
    cells = [('bf16', N, D, L) for N in (30e6, 50e6, 100e6) for D, L in ((13e6, 4.0), (50e6, 2.25))]
    fit = law.fit_law(cells, exponents='quartet')
    assert fit['params']['E'] < 0 and any('E = ' in p for p in fit['problems']), fit['problems']
    assert any('A / N^a' in p for p in fit['problems']), fit['problems']
    # the law's own losses raise nothing (test_law_fit_recovers_known_parameters), nor a fit that is
    # good though noisy
    rng = np.random.default_rng(3)
    noisy = [(g, N, D, L + rng.normal(0, 0.003))
             for g, N, D, L in means(synthetic_cells(TRUE, [30e6, 50e6, 100e6], [25e6, 50e6]))]
    assert law.fit_law(noisy)['problems'] == []

def test_law_fit_bounds_an_effective_factor_the_data_leave_free():
    """A recipe whose losses are the law without its N term (effN -> infinity): the fit stops
    effN at its bound, flags it, and does not overflow."""
    cells = means(synthetic_cells(TRUE, [30e6, 50e6, 100e6], [25e6, 50e6]))
    cells = [c for c in cells if c[0] == 'bf16']
    for N in (30e6, 100e6):
        for D in (25e6, 50e6):
            cells.append(('x', N, D, (TRUE['B'] / D ** TRUE['b']) ** TRUE['g'] + TRUE['E']))
    fit = law.fit_law(cells)
    assert fit['eff']['x'][0] == pytest.approx(math.exp(law.LOG_EFF_BOUND))
    assert any('x at the' in p and 'not pinned' in p for p in fit['problems']), fit['problems']

def test_report_fits_no_factors_for_a_recipe_at_one_size(tmp_path):
    """bf16 at 3 sizes x 2 budgets, quartet at one size x 2 budgets (a study's state before
    its second size has FP4 runs): two equations leave effN and effD unseparated. The report fits bf16, names
    quartet among the recipes it gives no factors for, and has no row for it."""
    for size in ('30m', '50m', '100m'):
        N = study.n_params(size, 512)
        for D in (12.5e6, 25e6):
            for group in ('bf16', 'quartet') if size == '30m' else ('bf16',):
                L = float(law.law_loss(N, D, TRUE, *EFF[group]))
                run = study.Run(size, D, group, 0, '')
                records.write_json(str(tmp_path / f'{run.id}.json'), dict(
                    id=run.id, group=group, recipe=group, variant='', seed=0, model_size=size, tokens=D,
                    n_params=N, epochs=0.1, status='ok', val_loss=L, val_loss_se=0.001, tokens_per_s=1e5,
                    git_commit='abc', corpus=dict(train_sha1='f00'),
                    curve=dict(train_loss=[8.0, L], val_steps=[0, 50], val_loss=[8.0, L])))
    _, fit = analysis.report(str(tmp_path), n_boot=10, log=lambda m: None)
    assert fit['eff'] == {} and fit['problems'] == []
    md = (tmp_path / 'report.md').read_text()
    assert 'at 1 size x 2 budgets: quartet' in md and '| quartet | ' not in md.split('Law fit')[1]

def test_law_fit_leaves_out_the_cells_below_a_token_ratio(tmp_path, monkeypatch):
    """bf16 at 3 sizes x 3 budgets of the law, plus a 4th budget far off it (what the earliest
    steps of training look like): with it the fit is poor; left out by min_tokens_per_param,
    the fit recovers the law's values, and the report names the cells it left out."""
    monkeypatch.setattr(analysis, 'plot_cell', lambda *a: None)  # 36 PNGs no check here reads
    sizes, budgets, early = ('30m', '50m', '100m'), (25e6, 50e6, 100e6), 3e6
    for size in sizes:
        N = study.n_params(size, 512)
        for D in budgets + (early,):
            L = float(law.law_loss(N, D, TRUE)) + (1.5 if D == early else 0.0)
            run = study.Run(size, D, 'bf16', 0, '')
            records.write_json(str(tmp_path / f'{run.id}.json'), dict(
                id=run.id, group='bf16', recipe='bf16', variant='', seed=0, model_size=size, tokens=D,
                n_params=N, epochs=0.1, status='ok', val_loss=L, val_loss_se=0.001, tokens_per_s=1e5,
                git_commit='abc', corpus=dict(train_sha1='f00'),
                curve=dict(train_loss=[8.0, L], val_steps=[0, 50], val_loss=[8.0, L])))
    _, every = analysis.report(str(tmp_path), n_boot=10, log=lambda m: None)
    assert every['n'] == 12 and every['rms'] > 0.05
    cutoff = 0.2  # tokens a parameter: the early budget is below it at every size, the others above
    assert early / study.n_params('30m', 512) < cutoff < 25e6 / study.n_params('100m', 512)
    _, fit = analysis.report(str(tmp_path), n_boot=10, log=lambda m: None, min_tokens_per_param=cutoff)
    assert fit['n'] == 9 and fit['rms'] < 1e-3, fit
    md = (tmp_path / 'report.md').read_text()
    assert 'Left out: the 3 cells 30m 3M, 50m 3M, 100m 3M, below 0.2 tokens a parameter.' in md
    # one measure a fit: with the split loss in the 25M and 100M cells, the 50M cells (per-seed
    # batches only) are left out, and named
    for size in sizes:
        for D in (25e6, 100e6):
            path = tmp_path / f"{study.Run(size, D, 'bf16', 0, '').id}.json"
            rec = json.loads(path.read_text())
            records.write_json(str(path), dict(rec, val_loss_split=rec['val_loss'], val_loss=rec['val_loss'] + 0.3))
    _, fit = analysis.report(str(tmp_path), n_boot=10, log=lambda m: None, min_tokens_per_param=cutoff)
    assert fit['n'] == 6 and fit['rms'] < 1e-3, fit  # the split losses are the law's: an exact fit
    md = (tmp_path / 'report.md').read_text()
    assert 'Left out: the 3 cells 30m 50M, 50m 50M, 100m 50M, without the whole-split loss' in md

def test_report_pairs_an_fp4_variant_with_its_twin(tmp_path):
    """bf16+root_fp4 (and root_fp4x2) against bf16+root (the twin: the same optimizer without
    FP4), paired by seed: the mean of the per-seed ratios; a variant without a twin gets none."""
    losses = {'bf16': (4.0, 4.1), 'bf16+root': (3.6, 3.5), 'bf16+root_fp4': (3.69, 3.57), 'bf16+adamw_fp4': (4.0, 4.1),
              'bf16+root_fp4x2': (3.6, 3.5)}
    for group, per_seed in losses.items():
        recipe, _, variant = group.partition('+')
        for seed, L in enumerate(per_seed):
            run = study.Run('30m', 13e6, recipe, seed, variant)
            records.write_json(str(tmp_path / f'{run.id}.json'), dict(
                id=run.id, group=group, recipe=recipe, variant=variant, seed=seed, model_size='30m',
                tokens=13e6, n_params=30e6, epochs=0.1, status='ok', val_loss=L, val_loss_se=0.01,
                tokens_per_s=1e5, git_commit='abc', corpus=dict(train_sha1='f00'),
                curve=dict(train_loss=[8.0, L], val_steps=[0, 10], val_loss=[8.0, L])))
    rows, _ = analysis.report(str(tmp_path), n_boot=10, log=lambda m: None)
    by = {r['group']: r for r in rows}
    want = (3.69 / 3.6 + 3.57 / 3.5) / 2 - 1
    assert by['bf16+root_fp4']['twin'] == 'bf16+root'
    assert by['bf16+root_fp4']['vs_twin']['rel'] == pytest.approx(want) and by['bf16+root_fp4']['vs_twin']['n'] == 2
    assert 'vs_twin' not in by['bf16+adamw_fp4'] and 'vs_twin' not in by['bf16+root']
    assert by['bf16+root_fp4x2']['twin'] == 'bf16+root' and by['bf16+root_fp4x2']['vs_twin']['rel'] == 0
    md = (tmp_path / 'report.md').read_text()
    sd = np.std([3.6, 3.5], ddof=1) / 3.55  # root's seed sd, relative: 1.99% < the gap's 2.54%
    assert f"| bf16+root | {100 * want:+.2f}% (sd {100 * sd:.2f}%: outside) |" in md
    assert '| bf16+adamw_fp4 | bf16 | +0.00% (sd 1.75%: within) |' in md  # against bf16 (4.0, 4.1): sd 0.0707 / 4.05


def test_fp4_recipe_with_its_own_optimizer_is_compared_to_bf16_under_that_optimizer(tmp_path):
    """fullstack+full trains with --optimizer=root_fp4: its gap is against bf16+root (the same
    optimizer without FP4), not against bf16 under AdamW; with no bf16+root runs, against bf16."""
    losses = {('bf16', ''): (4.0, 4.1), ('bf16', 'root'): (3.6, 3.5), ('fullstack', 'full'): (3.69, 3.57),
              ('fullstack', 'no_attn'): (3.60, 3.57)}
    flags = {'root': ['--optimizer=root'], 'full': ['--attention=nvfp4', '--optimizer=root_fp4'],
             'no_attn': ['--optimizer=root_fp4']}
    for (recipe, variant), pair in losses.items():
        for seed, L in enumerate(pair):
            run = study.Run('30m', 13e6, recipe, seed, variant)
            records.write_json(str(tmp_path / f'{run.id}.json'), dict(
                id=run.id, group=f'{recipe}+{variant}' if variant else recipe, recipe=recipe, variant=variant,
                flags=flags.get(variant, []), seed=seed, model_size='30m', tokens=13e6, n_params=30e6, epochs=0.1,
                status='ok', val_loss=L, val_loss_se=0.01, tokens_per_s=1e5, git_commit='abc',
                corpus=dict(train_sha1='f00'), curve=dict(train_loss=[8.0, L], val_steps=[0, 10], val_loss=[8.0, L])))
    rows, _ = analysis.report(str(tmp_path), n_boot=10, log=lambda m: None)
    full = next(r for r in rows if r['group'] == 'fullstack+full')
    assert full['ref'] == 'bf16+root'
    assert full['gap']['rel'] == pytest.approx((3.69 / 3.6 + 3.57 / 3.5) / 2 - 1)
    ablation = next(r for r in rows if r['group'] == 'fullstack+no_attn')  # against the whole recipe too
    assert ablation['ref'] == 'bf16+root' and ablation['base'] == 'fullstack+full'
    assert ablation['vs_base']['rel'] == pytest.approx((3.60 / 3.69 + 1) / 2 - 1)
    assert '| 30m | 13M | fullstack+no_attn | fullstack+full |' in (tmp_path / 'report.md').read_text()
    assert [g['ref'] for g in analysis.curve_gaps(records.load_records(str(tmp_path)))] == ['bf16+root'] * 2
    for seed in (0, 1):
        (tmp_path / f'30m-13M-bf16-root-s{seed}.json').unlink()
    rows, _ = analysis.report(str(tmp_path), n_boot=10, log=lambda m: None)
    assert next(r for r in rows if r['group'] == 'fullstack+full')['ref'] == 'bf16'


def test_a_variant_is_compared_with_the_closest_run_of_its_recipe():
    """own_reference: the recipe's group whose flags are the largest proper subset (one flag apart:
    what that flag changes), else the plain recipe, else an ablation's +full."""
    flags = {'nvfp4': [], 'nvfp4+root': ['--optimizer=root'],
             'nvfp4+root_ends_fp4': ['--optimizer=root', '--end_blocks=fp4'],
             'fullstack+full': ['--attention=nvfp4', '--optimizer=root_fp4'],
             'fullstack+ends_bf16': ['--attention=nvfp4', '--optimizer=root_fp4', '--end_blocks=bf16'],
             'fullstack+no_attn': ['--optimizer=root_fp4'], 'quartet+root': ['--optimizer=root'],
             'fullstack+refit50': ['--attention=nvfp4', '--optimizer=root_fp4', '--lora_refit_interval=50'],
             'fullstack+ends_bf16_refit50': ['--attention=nvfp4', '--optimizer=root_fp4', '--end_blocks=bf16',
                                             '--lora_refit_interval=50']}
    def record(group, f):  # coverage from --end_blocks: ends_bf16_refit50 is 4/6, as ends_bf16, not refit50
        ends = next((x.partition('=')[2] for x in f if x.startswith('--end_blocks')), 'auto')
        return dict(flags=f, model_size='30m', recipe=group.partition('+')[0], train_config=dict(end_blocks=ends))
    groups = {g: {0: record(g, f)} for g, f in flags.items()}
    own = {g: analysis.own_reference(g, groups) for g in groups}
    assert own == {'nvfp4': None, 'nvfp4+root': 'nvfp4', 'nvfp4+root_ends_fp4': 'nvfp4+root',
                   'fullstack+full': None, 'fullstack+ends_bf16': 'fullstack+full',
                   'fullstack+no_attn': 'fullstack+full', 'quartet+root': None,
                   'fullstack+refit50': 'fullstack+full', 'fullstack+ends_bf16_refit50': 'fullstack+ends_bf16'}
    del groups['nvfp4+root']
    assert analysis.own_reference('nvfp4+root_ends_fp4', groups) == 'nvfp4'
    # launch-only flags do not count; of two equally close runs, the one of the same code
    runs = {'bf16': ([], 'a'), 'bf16+root_fp4': (['--optimizer=root_fp4'], 'old'),
            'bf16+root_fp4_bf16m': (['--optimizer=root_fp4', '--compile_mode=default'], 'new'),
            'bf16+root_fp4_fp32adam': (['--optimizer=root_fp4', '--optimizer_states=bf16'], 'new')}
    groups = {g: {0: dict(flags=f, git_commit=c)} for g, (f, c) in runs.items()}
    assert analysis.own_reference('bf16+root_fp4_bf16m', groups) == 'bf16'
    assert analysis.own_reference('bf16+root_fp4_fp32adam', groups) == 'bf16+root_fp4_bf16m'
    runs['bf16+root_fp4'] = (runs['bf16+root_fp4'][0], 'new')  # same code: the name decides, stably
    groups = {g: {0: dict(flags=f, git_commit=c)} for g, (f, c) in runs.items()}
    assert analysis.own_reference('bf16+root_fp4_fp32adam', groups) == 'bf16+root_fp4_bf16m'


def test_the_table_shows_each_recipe_s_fp4_coverage(tmp_path):
    """nvfp4 keeps the first and last of 30m's 6 blocks in BF16, unless the run's train_config
    says end_blocks='fp4'; quartet runs all 6, or 4 with end_blocks='bf16'; bf16 none."""
    runs = {('bf16', '', None): 4.0, ('nvfp4', '', None): 4.1, ('nvfp4', 'ends_fp4', 'fp4'): 4.2,
            ('quartet', '', None): 4.3, ('quartet', 'ends_bf16', 'bf16'): 4.2}
    for (recipe, variant, ends), L in runs.items():
        run = study.Run('30m', 13e6, recipe, 0, variant)
        cfg = dict(recipe=recipe, model_size='30m', **({'end_blocks': ends} if ends else {}))
        records.write_json(str(tmp_path / f'{run.id}.json'), dict(
            id=run.id, group=f'{recipe}+{variant}' if variant else recipe, recipe=recipe, variant=variant,
            flags=[f'--end_blocks={ends}'] if ends else [], seed=0, model_size='30m', tokens=13e6, n_params=30e6,
            epochs=0.1, status='ok', val_loss=L, val_loss_se=0.01, tokens_per_s=1e5, git_commit='abc',
            train_config=cfg, corpus=dict(train_sha1='f00'),
            curve=dict(train_loss=[8.0, L], val_steps=[0, 10], val_loss=[8.0, L])))
    rows, _ = analysis.report(str(tmp_path), n_boot=10, log=lambda m: None)
    assert {r['group']: r['fp4_blocks'] for r in rows} == {
        'bf16': '0/6', 'nvfp4': '4/6', 'nvfp4+ends_fp4': '6/6', 'quartet': '6/6', 'quartet+ends_bf16': '4/6'}
    md = (tmp_path / 'report.md').read_text()
    assert '| recipe | FP4 blocks | seeds |' in md and '| nvfp4+ends_fp4 | 6/6 | 1 |' in md
    assert analysis.low_precision_blocks(dict(model_size='30m', recipe='fp3')) == '?'  # a retired recipe
    assert analysis.low_precision_blocks(dict(model_size='7b', recipe='nvfp4')) == '?'


def test_curve_gaps_pair_each_eval_by_seed(tmp_path):
    """quartet against bf16 at every shared eval after step 0, per seed; bf16 variants get none."""
    curves = {('bf16', 0): [8.0, 5.0, 4.0], ('bf16', 1): [8.0, 5.2, 4.2],
              ('quartet', 0): [8.0, 5.1, 4.04], ('quartet', 1): [8.0, 5.2, 4.41]}
    for (recipe, seed), val in curves.items():
        run = study.Run('30m', 13e6, recipe, seed, '')
        records.write_json(str(tmp_path / f'{run.id}.json'), dict(
            id=run.id, group=recipe, recipe=recipe, variant='', seed=seed, model_size='30m', tokens=13e6,
            n_params=30e6, epochs=0.1, status='ok', val_loss=val[-1], val_loss_se=0.01, tokens_per_s=1e5,
            git_commit='abc', corpus=dict(train_sha1='f00'),
            curve=dict(train_loss=[8.0, val[-1]], val_steps=[0, 5, 10], val_loss=val)))
    gaps = analysis.curve_gaps(records.load_records(str(tmp_path)))
    assert [(g['group'], g['ref'], g['step']) for g in gaps] == [('quartet', 'bf16', 5), ('quartet', 'bf16', 10)]
    assert gaps[0]['ref_loss'] == pytest.approx(5.1) and gaps[0]['gaps'] == pytest.approx([0.02, 0.0])
    assert gaps[1]['gaps'] == pytest.approx([0.01, 0.05])
    analysis.report(str(tmp_path), n_boot=10, log=lambda m: None)
    assert '| 30m | 13M | quartet | bf16 | 10 | 4.100 | +1.00%, +5.00% |' in (tmp_path / 'report.md').read_text()

def test_report_fits_the_law_from_run_records(tmp_path):
    """Run JSONs whose val losses follow the law (3 sizes x 2 budgets, 2 seeds, seed noise
    0.002): the report's gap table, variant table, law table near the truth, and PNGs."""
    rng = np.random.default_rng(2)
    eff = dict(EFF, **{'quartet+x': (0.6, 0.8)})
    for size in ('30m', '50m', '100m'):
        N = study.n_params(size, 512)
        for D in (12.5e6, 25e6):
            for seed in (0, 1):
                shift = rng.normal(0, 0.002)  # what a seed does to every recipe
                for group, (en, ed) in eff.items():
                    recipe, _, variant = group.partition('+')
                    L = float(law.law_loss(N, D, TRUE, en, ed)) + shift + rng.normal(0, 0.002)
                    run = study.Run(size, D, recipe, seed, variant)
                    curve = dict(train_loss=list(np.linspace(8, L, 50)), val_steps=[0, 25, 50],
                                 val_loss=[8.0, (8 + L) / 2, L])
                    records.write_json(str(tmp_path / f'{run.id}.json'), dict(
                        id=run.id, group=group, recipe=recipe, variant=variant, seed=seed,
                        model_size=size, tokens=D, n_params=N, epochs=0.1, status='ok',
                        val_loss=L, val_loss_se=0.001, tokens_per_s=1e5, git_commit='abc',
                        corpus=dict(train_sha1='f00'), curve=curve))
    rows, fit = analysis.report(str(tmp_path), n_boot=30, log=lambda m: None)
    assert fit['exponents'] == 'quartet' and len(rows) == 6 * 4
    assert fit['eff']['quartet'] == pytest.approx(EFF['quartet'], abs=0.1)
    assert set(fit['bootstrap']) == {'quartet', 'nvfp4', 'quartet+x'}
    q = next(r for r in rows if r['group'] == 'quartet+x' and r['size'] == '30m')
    assert q['ref'] == 'bf16' and q['vs_base']['n'] == 2 and q['gap']['rel'] > 0
    md = (tmp_path / 'report.md').read_text()
    assert "exponents fixed to Quartet's BF16 fit" in md and '| quartet | 0.' in md
    assert 'Variants against their own recipe' in md and '| 100m | 25M | quartet+x |' in md
    n, published = study.n_params('30m', 512), law.QUARTET_LAW  # the published law's own prediction
    pred = law.law_loss(n, 12.5e6, published, 0.658, 0.822) / law.law_loss(n, 12.5e6, published) - 1
    assert f'quartet at 30m, 12.5M: {100 * pred:+.2f}% predicted' in md and 0.01 < pred < 0.05
    for png in ('law.png', 'curves_30m_12.5M.png', 'curves_100m_25M.png'):
        assert (tmp_path / png).stat().st_size > 10_000

def test_report_compares_the_split_loss_where_every_run_of_a_cell_has_it(tmp_path):
    """A cell whose runs all have val_loss_split is compared on it (the same text for every run);
    a cell where one lacks it falls back to val_loss for all, so no pair mixes the two."""
    def rec(size, recipe, seed, loss, split):
        run = study.Run(size, 1e6, recipe, seed)
        records.write_json(str(tmp_path / f'{run.id}.json'), dict(
            id=run.id, group=recipe, recipe=recipe, variant='', seed=seed, model_size=size, tokens=1e6,
            n_params=study.n_params(size, 512), epochs=0.1, status='ok', val_loss=loss, val_loss_se=0.01,
            val_loss_split=split, tokens_per_s=1e5, git_commit='abc', corpus=dict(train_sha1='f00'),
            curve=dict(train_loss=[5.0, loss], val_steps=[0, 2], val_loss=[5.0, loss])))
    for seed, (b, q) in enumerate([(3.0, 3.3), (3.2, 3.3)]):  # per-seed batches: noisy
        rec('30m', 'bf16', seed, b, 2.0 + 0.01 * seed)
        rec('30m', 'quartet', seed, q, 2.04 + 0.01 * seed)
        rec('50m', 'bf16', seed, b, 1.9)
        rec('50m', 'quartet', seed, q, None if seed else 1.95)
    rows, _ = analysis.report(str(tmp_path), n_boot=10, log=lambda m: None)
    by = {(r['size'], r['group']): r for r in rows}
    assert by['30m', 'bf16']['eval'] == 'split' and by['30m', 'bf16']['mean'] == pytest.approx(2.005)
    assert by['30m', 'quartet']['gap']['rel'] == pytest.approx((2.04 / 2.0 + 2.05 / 2.01) / 2 - 1)
    assert by['50m', 'bf16']['eval'] == 'batches' and by['50m', 'bf16']['mean'] == pytest.approx(3.1)
    assert by['50m', 'quartet']['gap']['rel'] == pytest.approx((3.3 / 3.0 + 3.3 / 3.2) / 2 - 1)
    md = (tmp_path / 'report.md').read_text()
    assert '| whole split |' in md and '| per-seed batches, SE 0.0100 |' in md

def test_law_fit_takes_the_runs_of_a_cell_that_have_the_split_loss(tmp_path):
    """The law fits one measure, the whole-split loss. In a cell where only some runs have it
    (30m 50M here: bf16 and quartet seed 0 predate it), the runs without it are left out and
    named, and each group's mean is over the seeds that have it: quartet's cell there is seed 1
    alone. Its batch losses are far off the law; were they used, the fit would move."""
    def rec(size, D, group, seed, split, batches):
        N = study.n_params(size, 512)
        run = study.Run(size, D, group, seed)
        records.write_json(str(tmp_path / f'{run.id}.json'), dict(
            id=run.id, group=group, recipe=group, variant='', seed=seed, model_size=size, tokens=D,
            n_params=N, epochs=0.1, status='ok', val_loss=batches, val_loss_se=0.01, val_loss_split=split,
            tokens_per_s=1e5, git_commit='abc', corpus=dict(train_sha1='f00'),
            curve=dict(train_loss=[8.0, batches], val_steps=[0, 2], val_loss=[8.0, batches])))
    for size in ('30m', '50m', '100m'):
        N = study.n_params(size, 512)
        for D in (25e6, 50e6):
            for seed in (0, 1):
                for group in ('bf16', 'quartet') if size != '100m' else ('bf16',):
                    L = float(law.law_loss(N, D, TRUE, *EFF[group]))
                    old = size == '30m' and D == 50e6 and seed == 0 and group == 'quartet'
                    rec(size, D, group, seed, None if old or (size == '30m' and D == 50e6 and group == 'bf16') else L,
                        L + 0.5)
    _, fit = analysis.report(str(tmp_path), exponents='quartet', n_boot=10, log=lambda m: None)
    assert fit['n'] == 5 + 4 and fit['rms'] < 1e-4, fit  # bf16 without 30m 50M; quartet's 4 cells
    assert fit['eff']['quartet'] == pytest.approx(EFF['quartet'], rel=1e-3)
    md = (tmp_path / 'report.md').read_text()
    assert ('Left out of the cell 30m 50M, without the whole-split loss: bf16 s0,1, quartet s0 '
            "(its other runs are in, each group's mean over the seeds it has).") in md
    assert 'cannot vary a cell of one seed (bf16 0 of 5, quartet 1 of 4)' in md  # seeds agree here: no noise to pool


def test_report_lists_the_reruns_against_their_recorded_runs(tmp_path):
    """study_repeats/ beside the results (study.merge): each rerun against the recorded run of
    its id, on the split loss where both have it, with the median and largest |change|."""
    res = tmp_path / 'study'
    res.mkdir()
    def rec(seed, loss, split):
        run = study.Run('30m', 1e6, 'bf16', seed)
        return dict(id=run.id, group='bf16', recipe='bf16', variant='', seed=seed, model_size='30m', tokens=1e6,
                    n_params=30e6, epochs=0.1, status='ok', val_loss=loss, val_loss_se=0.01, val_loss_split=split,
                    tokens_per_s=1e5, git_commit='abc', corpus=dict(train_sha1='f00'),
                    curve=dict(train_loss=[5.0, loss], val_steps=[0, 2], val_loss=[5.0, loss]))
    for seed in (0, 1):
        records.write_json(str(res / f'30m-1M-bf16-s{seed}.json'), rec(seed, 3.0, 2.0))
    assert analysis.rerun_table(str(res), records.load_records(str(res))) == ''  # none yet: no table
    (tmp_path / 'study_repeats').mkdir()
    records.write_json(str(tmp_path / 'study_repeats' / '30m-1M-bf16-s0.1.json'), rec(0, 3.3, 2.02))  # +1% split
    records.write_json(str(tmp_path / 'study_repeats' / '30m-1M-bf16-s1.1.json'), rec(1, 2.97, None))  # -1%
    records.write_json(str(tmp_path / 'study_repeats' / '30m-1M-bf16-s1.2.json'), rec(1, 3.09, None))  # +3%
    analysis.report(str(res), n_boot=10, log=lambda m: None)
    md = (res / 'report.md').read_text()
    assert '| 30m-1M-bf16-s0 | 2.0000 | 2.0200 | +1.00% | whole split |' in md
    assert '| 30m-1M-bf16-s1 | 3.0000 | 2.9700 | -1.00% | per-seed batches |' in md
    assert '| 30m-1M-bf16-s1 | 3.0000 | 3.0900 | +3.00% | per-seed batches |' in md
    assert '|change| median 1.00%, largest 3.00%, over 3 pairs' in md

def test_fp4_recipes_are_compared_with_each_other_only_like_for_like(tmp_path):
    """equal_coverage_pairs: two recipes of a cell at the same FP4 coverage under the same optimizer
    family, paired by seed; not nvfp4 (4/6) against quartet (6/6), not quartet+root against quartet2
    (AdamW) when bf16+root is missing, not an ablation, not a recipe against its own variant."""
    runs = {('bf16', '', ()): (4.0, 4.1), ('nvfp4', '', ()): (4.1, 4.2), ('quartet', '', ()): (4.2, 4.3),
            ('quartet2', '', ()): (4.16, 4.3), ('quartet', 'root', ('--optimizer=root',)): (3.7, 3.8),
            ('nvfp4', 'ends_fp4', ('--end_blocks=fp4',)): (4.2, 4.2),
            ('fullstack', 'no_lora', ('--lora_rank=0',)): (4.0, 4.0)}
    for (recipe, variant, flags), per_seed in runs.items():
        for seed, L in enumerate(per_seed):
            run = study.Run('30m', 13e6, recipe, seed, variant)
            ends = [f.partition('=')[2] for f in flags if f.startswith('--end_blocks')]
            records.write_json(str(tmp_path / f'{run.id}.json'), dict(
                id=run.id, group=f'{recipe}+{variant}' if variant else recipe, recipe=recipe, variant=variant,
                flags=list(flags), seed=seed, model_size='30m', tokens=13e6, n_params=30e6, epochs=0.1, status='ok',
                val_loss=L, val_loss_se=0.01, tokens_per_s=1e5, git_commit='abc', corpus=dict(train_sha1='f00'),
                train_config=dict(recipe=recipe, model_size='30m', **({'end_blocks': ends[0]} if ends else {})),
                curve=dict(train_loss=[8.0, L], val_steps=[0, 10], val_loss=[8.0, L])))
    pairs = analysis.equal_coverage_pairs(records.load_records(str(tmp_path)))
    got = {(p['group'], p['against']): p for p in pairs}
    assert set(got) == {('quartet2', 'quartet'), ('nvfp4+ends_fp4', 'quartet'), ('nvfp4+ends_fp4', 'quartet2')}
    assert got['quartet2', 'quartet']['gap']['rel'] == pytest.approx((4.16 / 4.2 + 1) / 2 - 1)
    assert got['quartet2', 'quartet']['blocks'] == '6/6' and got['quartet2', 'quartet']['ref'] == 'bf16'
    analysis.report(str(tmp_path), n_boot=10, log=lambda m: None)
    want = f"| 30m | 13M | 6/6 | quartet2 | quartet | {100 * ((4.16 / 4.2 + 1) / 2 - 1):+.2f}% |"
    assert want in (tmp_path / 'report.md').read_text()
