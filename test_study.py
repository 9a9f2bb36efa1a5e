"""
Tests for study.py (and the two train.py pieces it reads: the eval standard error and the
repeated-data warning). CPU: synthetic losses for the statistics and the law fit, a fake
launcher for the resume logic, and tiny real runs on a synthetic corpus.

$ python -m pytest test_study.py -q
"""

import json
import math
import os

import numpy as np
import pytest
import torch

import study
import train
from model import GPT, config_for
from test_train import write_corpus

try:
    import fp4
    HAVE_FP4 = hasattr(fp4, 'to_fp4')
except ImportError:
    HAVE_FP4 = False

CPU = ['--device=cpu', '--dtype=float32', '--compile=False', '--learning_rate=0.01']
TINY = dict(block_size=32, batch_size=8, gradient_accumulation_steps=1, eval_iters=4,
            always_save_checkpoint=False, log_interval=5)

# -----------------------------------------------------------------------------
# paired intervals

def test_t_quantile_textbook_values():
    # two-sided 95% (and one 99%) critical values of Student's t, from any printed table
    table = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 5: 2.5706, 10: 2.2281, 30: 2.0423}
    for df, t in table.items():
        assert study.t_quantile(0.975, df) == pytest.approx(t, abs=1e-4), df
    assert study.t_quantile(0.995, 4) == pytest.approx(4.6041, abs=1e-4)
    z = 1.959963984540054  # large df: the normal's quantile + (z^3 + z) / (4 df) (Cornish-Fisher)
    assert study.t_quantile(0.975, 20000) == pytest.approx(z + (z ** 3 + z) / 80000, abs=1e-7)
    for df in (1, 2, 7, 8):  # the CDF is exact: it inverts the quantile
        assert study.t_two_sided(study.t_quantile(0.9, df), df) == pytest.approx(0.8, abs=1e-12)
    with pytest.raises(ValueError, match='0.5 < p < 1'):
        study.t_quantile(0.2, 3)

def test_paired_gap_arithmetic():
    ref = {0: 3.0, 1: 3.1, 2: 2.9}
    other = {s: ref[s] * (1 + g) for s, g in zip(ref, (0.01, 0.02, 0.03))}
    other[7] = 9.9  # a seed bf16 lacks: not a pair, ignored
    gap = study.paired_gap(ref, other)
    assert gap['n'] == 3 and gap['seeds'] == [0, 1, 2]
    half = 4.302652729911275 * 0.01 / math.sqrt(3)  # t(0.975, 2) * sd / sqrt(n)
    assert gap['rel'] == pytest.approx(0.02, abs=1e-12)
    assert gap['rel_lo'] == pytest.approx(0.02 - half, abs=1e-9)
    assert gap['rel_hi'] == pytest.approx(0.02 + half, abs=1e-9)
    nats = [other[s] - ref[s] for s in ref]  # 0.03, 0.062, 0.087
    assert gap['nats'] == pytest.approx(np.mean(nats), abs=1e-12)
    assert gap['nats_hi'] - gap['nats'] == pytest.approx(
        4.302652729911275 * np.std(nats, ddof=1) / math.sqrt(3), abs=1e-9)
    one = study.paired_gap({0: 3.0}, {0: 3.03})
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
        g = study.paired_gap(ref, other)
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
                L = float(study.law_loss(N, D, params, en, ed))
                out[(g, N, D)] = {s: L + (rng.normal(0, noise) if noise else 0.0) for s in seeds}
    return out

def means(seed_losses):
    return [(g, N, D, float(np.mean(list(v.values())))) for (g, N, D), v in seed_losses.items()]

def test_law_fit_recovers_known_parameters():
    cells = means(synthetic_cells(TRUE, [30e6, 50e6, 100e6], [25e6, 50e6]))
    fit = study.fit_law(cells, exponents='quartet')
    for k in ('A', 'B', 'E'):
        assert fit['params'][k] == pytest.approx(TRUE[k], rel=1e-6), k
    for g in ('quartet', 'nvfp4'):
        assert fit['eff'][g] == pytest.approx(EFF[g], rel=1e-6), g
    assert fit['rms'] < 1e-9 and fit['dof'] == 18 - 7
    # 3 sizes x 2 budgets cannot pin the exponents: auto keeps Quartet's and says so
    auto = study.fit_auto(cells)
    assert auto['exponents'] == 'quartet' and 'cannot pin' in auto['note']

def test_law_fit_free_exponents():
    """Exponents unlike Quartet's, on 4 sizes x 4 budgets: auto frees and recovers them."""
    true = dict(TRUE, a=0.5, b=0.62, g=0.3, A=2e4, B=4e5)
    cells = means(synthetic_cells(true, [30e6, 50e6, 100e6, 200e6], [12e6, 25e6, 50e6, 100e6]))
    fit = study.fit_auto(cells)
    assert fit['exponents'] == 'free' and 'fitted' in fit['note']
    for k in ('a', 'b', 'g', 'E'):
        assert fit['params'][k] == pytest.approx(true[k], rel=1e-4), k
    assert fit['eff']['quartet'] == pytest.approx(EFF['quartet'], rel=1e-4)
    with pytest.raises(ValueError, match='reference recipe'):
        study.fit_law([c for c in cells if c[0] != 'bf16'])

def test_law_fit_with_seed_noise():
    """Noise of 0.003 nats a run, 3 seeds: effN, effD within 4 standard errors of the truth
    (the fit's own, from the Jacobian), and the bootstrap interval over seeds around the fit."""
    rng = np.random.default_rng(1)
    seed_losses = synthetic_cells(TRUE, [30e6, 50e6, 100e6], [25e6, 50e6], 0.003, (0, 1, 2), rng)
    fit = study.fit_law(means(seed_losses))
    boot = study.bootstrap_eff(seed_losses, 'bf16', 'quartet', fit['theta'], n_boot=40)
    for g in ('quartet', 'nvfp4'):
        for j in (0, 1):
            est, se, truth = fit['eff'][g][j], fit['eff_se'][g][j], EFF[g][j]
            assert 0 < se < 0.2 and abs(est - truth) < 4 * se, (g, j, est, se)
            lo, hi = boot[g][j]
            assert lo < hi and lo <= est * 1.02 and est <= hi * 1.02, (g, j, lo, est, hi)

def test_report_pairs_an_fp4_variant_with_its_twin(tmp_path):
    """bf16+root_fp4 (and root_fp4x2) against bf16+root (the twin: the same optimizer without
    FP4), paired by seed: the mean of the per-seed ratios; a variant without a twin gets none."""
    losses = {'bf16': (4.0, 4.1), 'bf16+root': (3.6, 3.5), 'bf16+root_fp4': (3.69, 3.57), 'bf16+adamw_fp4': (4.0, 4.1),
              'bf16+root_fp4x2': (3.6, 3.5)}
    for group, per_seed in losses.items():
        recipe, _, variant = group.partition('+')
        for seed, L in enumerate(per_seed):
            run = study.Run('30m', 13e6, recipe, seed, variant)
            study.write_json(str(tmp_path / f'{run.id}.json'), dict(
                id=run.id, group=group, recipe=recipe, variant=variant, seed=seed, model_size='30m',
                tokens=13e6, n_params=30e6, epochs=0.1, status='ok', val_loss=L, val_loss_se=0.01,
                tokens_per_s=1e5, git_commit='abc', corpus=dict(train_sha1='f00'),
                curve=dict(train_loss=[8.0, L], val_steps=[0, 10], val_loss=[8.0, L])))
    rows, _ = study.report(str(tmp_path), n_boot=10, log=lambda m: None)
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
            study.write_json(str(tmp_path / f'{run.id}.json'), dict(
                id=run.id, group=f'{recipe}+{variant}' if variant else recipe, recipe=recipe, variant=variant,
                flags=flags.get(variant, []), seed=seed, model_size='30m', tokens=13e6, n_params=30e6, epochs=0.1,
                status='ok', val_loss=L, val_loss_se=0.01, tokens_per_s=1e5, git_commit='abc',
                corpus=dict(train_sha1='f00'), curve=dict(train_loss=[8.0, L], val_steps=[0, 10], val_loss=[8.0, L])))
    rows, _ = study.report(str(tmp_path), n_boot=10, log=lambda m: None)
    full = next(r for r in rows if r['group'] == 'fullstack+full')
    assert full['ref'] == 'bf16+root'
    assert full['gap']['rel'] == pytest.approx((3.69 / 3.6 + 3.57 / 3.5) / 2 - 1)
    ablation = next(r for r in rows if r['group'] == 'fullstack+no_attn')  # against the whole recipe too
    assert ablation['ref'] == 'bf16+root' and ablation['base'] == 'fullstack+full'
    assert ablation['vs_base']['rel'] == pytest.approx((3.60 / 3.69 + 1) / 2 - 1)
    assert '| 30m | 13M | fullstack+no_attn | fullstack+full |' in (tmp_path / 'report.md').read_text()
    assert [g['ref'] for g in study.curve_gaps(study.load_records(str(tmp_path)))] == ['bf16+root'] * 2
    for seed in (0, 1):
        (tmp_path / f'30m-13M-bf16-root-s{seed}.json').unlink()
    rows, _ = study.report(str(tmp_path), n_boot=10, log=lambda m: None)
    assert next(r for r in rows if r['group'] == 'fullstack+full')['ref'] == 'bf16'


def test_curve_gaps_pair_each_eval_by_seed(tmp_path):
    """quartet against bf16 at every shared eval after step 0, per seed; bf16 variants get none."""
    curves = {('bf16', 0): [8.0, 5.0, 4.0], ('bf16', 1): [8.0, 5.2, 4.2],
              ('quartet', 0): [8.0, 5.1, 4.04], ('quartet', 1): [8.0, 5.2, 4.41]}
    for (recipe, seed), val in curves.items():
        run = study.Run('30m', 13e6, recipe, seed, '')
        study.write_json(str(tmp_path / f'{run.id}.json'), dict(
            id=run.id, group=recipe, recipe=recipe, variant='', seed=seed, model_size='30m', tokens=13e6,
            n_params=30e6, epochs=0.1, status='ok', val_loss=val[-1], val_loss_se=0.01, tokens_per_s=1e5,
            git_commit='abc', corpus=dict(train_sha1='f00'),
            curve=dict(train_loss=[8.0, val[-1]], val_steps=[0, 5, 10], val_loss=val)))
    gaps = study.curve_gaps(study.load_records(str(tmp_path)))
    assert [(g['group'], g['ref'], g['step']) for g in gaps] == [('quartet', 'bf16', 5), ('quartet', 'bf16', 10)]
    assert gaps[0]['ref_loss'] == pytest.approx(5.1) and gaps[0]['gaps'] == pytest.approx([0.02, 0.0])
    assert gaps[1]['gaps'] == pytest.approx([0.01, 0.05])
    study.report(str(tmp_path), n_boot=10, log=lambda m: None)
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
                    L = float(study.law_loss(N, D, TRUE, en, ed)) + shift + rng.normal(0, 0.002)
                    run = study.Run(size, D, recipe, seed, variant)
                    curve = dict(train_loss=list(np.linspace(8, L, 50)), val_steps=[0, 25, 50],
                                 val_loss=[8.0, (8 + L) / 2, L])
                    study.write_json(str(tmp_path / f'{run.id}.json'), dict(
                        id=run.id, group=group, recipe=recipe, variant=variant, seed=seed,
                        model_size=size, tokens=D, n_params=N, epochs=0.1, status='ok',
                        val_loss=L, val_loss_se=0.001, tokens_per_s=1e5, git_commit='abc',
                        corpus=dict(train_sha1='f00'), curve=curve))
    rows, fit = study.report(str(tmp_path), n_boot=30, log=lambda m: None)
    assert fit['exponents'] == 'quartet' and len(rows) == 6 * 4
    assert fit['eff']['quartet'] == pytest.approx(EFF['quartet'], abs=0.1)
    assert set(fit['bootstrap']) == {'quartet', 'nvfp4', 'quartet+x'}
    q = next(r for r in rows if r['group'] == 'quartet+x' and r['size'] == '30m')
    assert q['ref'] == 'bf16' and q['vs_base']['n'] == 2 and q['gap']['rel'] > 0
    md = (tmp_path / 'report.md').read_text()
    assert "exponents fixed to Quartet's BF16 fit" in md and '| quartet | 0.' in md
    assert 'Variants against their own recipe' in md and '| 100m | 25M | quartet+x |' in md
    n, law = study.n_params('30m', 512), study.QUARTET_LAW  # the published law's own prediction
    pred = study.law_loss(n, 12.5e6, law, 0.658, 0.822) / study.law_loss(n, 12.5e6, law) - 1
    assert f'quartet at 30m, 12.5M: {100 * pred:+.2f}% predicted' in md and 0.01 < pred < 0.05
    for png in ('law.png', 'curves_30m_12.5M.png', 'curves_100m_25M.png'):
        assert (tmp_path / png).stat().st_size > 10_000

# -----------------------------------------------------------------------------
# the grid, the config a run gets, resuming

def test_grid_and_train_config(tmp_path):
    runs = study.grid(['bf16', 'quartet'], [0, 1], ['30m'], [50e6])
    assert [r.id for r in runs] == ['30m-50M-bf16-s0', '30m-50M-quartet-s0',
                                    '30m-50M-bf16-s1', '30m-50M-quartet-s1']  # seed-major
    cfg = study.train_config(runs[1], work_dir=str(tmp_path))
    assert cfg['max_iters'] == round(50e6 / 32768) == 1526 and cfg['eval_interval'] == 382
    assert (cfg['recipe'], cfg['seed'], cfg['model_size']) == ('quartet', 0, '30m')
    assert cfg['out_dir'] == str(tmp_path / '30m-50M-quartet-s0')
    assert cfg['eval_iters'] == 50  # 50M tokens: SETTINGS' 50 batches an eval; shorter runs fewer
    assert [study.train_config(r)['eval_iters'] for r in study.grid(['bf16'], [0], ['30m'], [13e6, 1e6, 1e9])] == [13, 10, 50]
    assert study.train_config(study.grid(['bf16'], [0], ['30m'], [1e6], 'e', ['--eval_iters=7'])[0])['eval_iters'] == 7
    var = study.grid(['quartet'], [2], ['50m'], [25e6], 'lr_low', ['--learning_rate=3e-4'])[0]
    assert var.id == '50m-25M-quartet-lr_low-s2' and var.group == 'quartet+lr_low'
    assert study.train_config(var)['learning_rate'] == 3e-4  # the variant's flags win
    with pytest.raises(ValueError, match='--variant'):
        study.grid(['bf16'], [0], ['30m'], [1e6], '', ['--learning_rate=1e-3'])
    with pytest.raises(ValueError, match='unknown recipe'):
        study.grid(['fp3'], [0], ['30m'], [1e6])
    with pytest.raises(ValueError, match='set by the study'):
        study.train_config(study.grid(['bf16'], [0], ['30m'], [1e6], 'x', ['--seed=5'])[0])
    with pytest.raises(train.configurator.ConfigError, match='no_such_key'):
        study.train_config(study.grid(['bf16'], [0], ['30m'], [1e6], 'x', ['--no_such_key=1'])[0])

def fake_start(outcomes):
    """A stand-in for study.start: writes what train.py would (summary.json, train.log) with a
    loss from outcomes[run.id] (a float, 'diverge' or 'fail') and returns the exit status."""
    started = []

    def start(run, cfg, inprocess):
        started.append(run.id)
        os.makedirs(cfg['out_dir'], exist_ok=True)
        outcome = outcomes.get(run.id, 3.0)
        log = os.path.join(cfg['out_dir'], 'train.log')
        if outcome == 'diverge':
            with open(log, 'w') as f:
                f.write('non-finite loss (nan) or gradient norm (nan) at step 3: stopped\n')
            return 1
        if outcome == 'fail':
            return 1
        curve = dict(steps=[0, 1], train_loss=[5.0, outcome], val_steps=[0, 2],
                     val_loss=[5.0, outcome], eval_train_loss=[5.0, outcome], val_loss_se=[0.1, 0.01])
        split = outcome - 0.5 if cfg.get('eval_split_tokens') else None  # train.py: None when off
        with open(os.path.join(cfg['out_dir'], 'summary.json'), 'w') as f:
            json.dump(dict(val_loss=outcome, val_loss_split=split, val_split_tokens=256 if split else 0,
                           tokens_per_s=1e5, wall_s=1.0, peak_mem_gib=1.0, device='cpu', loss_curve=curve), f)
        return 0
    return start, started

@pytest.fixture
def no_corpus(monkeypatch):
    monkeypatch.setattr(study, 'corpus', lambda cfg: dict(train_tokens=10**9, train_sha1='x', source='fake'))

def test_resume_skips_finished_runs(tmp_path, monkeypatch, no_corpus):
    results, work = str(tmp_path / 'res'), str(tmp_path / 'work')
    runs = study.grid(['bf16', 'quartet'], [0, 1], ['tiny'], [1e4])
    outcomes = {'tiny-10K-quartet-s1': 'diverge', 'tiny-10K-bf16-s1': 'fail'}
    start, started = fake_start(outcomes)
    monkeypatch.setattr(study, 'start', start)
    kw = dict(settings=TINY, work_dir=work, log=lambda m: None)
    new, left = study.run_study(runs, results, **kw)
    assert started == [r.id for r in runs]
    assert sorted(r['id'] for r in new) == ['tiny-10K-bf16-s0', 'tiny-10K-quartet-s0', 'tiny-10K-quartet-s1']
    assert [r.id for r in left] == ['tiny-10K-bf16-s1']  # failed: no JSON, retried next time
    rec = study.load_records(results)['tiny-10K-quartet-s1']
    assert rec['status'] == 'diverged' and rec['diverged_step'] == 3
    assert study.load_records(results)['tiny-10K-bf16-s0']['val_loss_se'] == 0.01
    # the second call runs only what has no JSON
    started.clear()
    outcomes.clear()
    new, left = study.run_study(runs, results, **kw)
    assert started == ['tiny-10K-bf16-s1'] and not left
    started.clear()
    assert study.run_study(runs, results, **kw) == ([], []) and not started
    os.remove(os.path.join(results, 'tiny-10K-quartet-s0.json'))
    study.run_study(runs, results, **kw)
    assert started == ['tiny-10K-quartet-s0']
    # the same ids under changed settings: an error naming what changed, nothing run
    with pytest.raises(ValueError, match='eval_iters: 4 -> 5'):
        study.run_study(runs, results, **dict(kw, settings=dict(TINY, eval_iters=5)))

def test_a_measure_only_setting_keeps_the_runs_recorded_without_it(tmp_path, monkeypatch, no_corpus):
    """eval_split_tokens only adds a number after training: runs recorded before it existed are
    reused (and report without it); a changed value is another run, an error; new runs record it."""
    results = str(tmp_path / 'res')
    start, started = fake_start({'tiny-10K-bf16-s1': 2.5})
    monkeypatch.setattr(study, 'start', start)
    kw = dict(work_dir=str(tmp_path / 'w'), log=lambda m: None)
    study.run_study(study.grid(['bf16'], [0], ['tiny'], [1e4]), results, settings=TINY, **kw)
    assert 'eval_split_tokens' not in study.load_records(results)['tiny-10K-bf16-s0']['train_config']
    started.clear()
    with_split = dict(TINY, eval_split_tokens=256)
    study.run_study(study.grid(['bf16'], [0, 1], ['tiny'], [1e4]), results, settings=with_split, **kw)
    assert started == ['tiny-10K-bf16-s1']
    recs = study.load_records(results)
    assert recs['tiny-10K-bf16-s1']['val_loss_split'] == 2.0 and recs['tiny-10K-bf16-s0']['val_loss_split'] is None
    with pytest.raises(ValueError, match='eval_split_tokens: 256 -> 512'):
        study.run_study(study.grid(['bf16'], [1], ['tiny'], [1e4]), results,
                        settings=dict(TINY, eval_split_tokens=512), **kw)

def test_report_compares_the_split_loss_where_every_run_of_a_cell_has_it(tmp_path):
    """A cell whose runs all have val_loss_split is compared on it (the same text for every run);
    a cell where one lacks it falls back to val_loss for all, so no pair mixes the two."""
    def rec(size, recipe, seed, loss, split):
        run = study.Run(size, 1e6, recipe, seed)
        study.write_json(str(tmp_path / f'{run.id}.json'), dict(
            id=run.id, group=recipe, recipe=recipe, variant='', seed=seed, model_size=size, tokens=1e6,
            n_params=study.n_params(size, 512), epochs=0.1, status='ok', val_loss=loss, val_loss_se=0.01,
            val_loss_split=split, tokens_per_s=1e5, git_commit='abc', corpus=dict(train_sha1='f00'),
            curve=dict(train_loss=[5.0, loss], val_steps=[0, 2], val_loss=[5.0, loss])))
    for seed, (b, q) in enumerate([(3.0, 3.3), (3.2, 3.3)]):  # per-seed batches: noisy
        rec('30m', 'bf16', seed, b, 2.0 + 0.01 * seed)
        rec('30m', 'quartet', seed, q, 2.04 + 0.01 * seed)
        rec('50m', 'bf16', seed, b, 1.9)
        rec('50m', 'quartet', seed, q, None if seed else 1.95)
    rows, _ = study.report(str(tmp_path), n_boot=10, log=lambda m: None)
    by = {(r['size'], r['group']): r for r in rows}
    assert by['30m', 'bf16']['eval'] == 'split' and by['30m', 'bf16']['mean'] == pytest.approx(2.005)
    assert by['30m', 'quartet']['gap']['rel'] == pytest.approx((2.04 / 2.0 + 2.05 / 2.01) / 2 - 1)
    assert by['50m', 'bf16']['eval'] == 'batches' and by['50m', 'bf16']['mean'] == pytest.approx(3.1)
    assert by['50m', 'quartet']['gap']['rel'] == pytest.approx((3.3 / 3.0 + 3.3 / 3.2) / 2 - 1)
    md = (tmp_path / 'report.md').read_text()
    assert '| whole split |' in md and '| per-seed batches, SE 0.0100 |' in md

def test_budget_starts_only_what_fits(tmp_path, monkeypatch, no_corpus):
    start, started = fake_start({})
    monkeypatch.setattr(study, 'start', start)
    monkeypatch.setattr(study, 'estimate_s', lambda run, cfg, records, directory, jobs: 600.0 if run.seed else 1.0)
    runs = study.grid(['bf16'], [0, 1, 2], ['tiny'], [1e4])
    bundle = str(tmp_path / 'study.tgz')
    new, left = study.run_study(runs, str(tmp_path / 'res'), settings=TINY, budget_s=300,
                                work_dir=str(tmp_path / 'w'), bundle=bundle, log=lambda m: None)
    assert started == ['tiny-10K-bf16-s0'] and [r.id for r in left] == ['tiny-10K-bf16-s1', 'tiny-10K-bf16-s2']
    import tarfile
    with tarfile.open(bundle) as tar:
        assert 'res/tiny-10K-bf16-s0.json' in tar.getnames()

def test_budget_waits_rather_than_skips_when_sharing_is_what_does_not_fit(tmp_path, monkeypatch, no_corpus):
    """jobs=3 under a budget that fits one run alone but not three sharing the GPU (estimate_s
    grows with the runs sharing): each starts once the one before it finished, none is skipped;
    a run that does not fit even alone is skipped. Records say how many shared the GPU."""
    start, started = fake_start({})
    monkeypatch.setattr(study, 'start', start)
    monkeypatch.setattr(study, 'estimate_s',
                        lambda run, cfg, records, directory, jobs: (1000.0 if run.seed == 3 else 200.0) * jobs)
    runs = study.grid(['bf16'], [0, 1, 2, 3], ['tiny'], [1e4])
    new, left = study.run_study(runs, str(tmp_path / 'res'), settings=TINY, budget_s=300, jobs=3,
                                work_dir=str(tmp_path / 'w'), log=lambda m: None)
    assert started == [f'tiny-10K-bf16-s{i}' for i in range(3)] and [r.id for r in left] == ['tiny-10K-bf16-s3']
    assert [r['jobs'] for r in new] == [1, 1, 1]

def test_estimate_from_finished_runs(tmp_path):
    run = study.grid(['quartet'], [0], ['30m'], [25e6])[0]
    cfg = study.train_config(run)  # 763 steps of 32768 tokens
    tokens = 763 * 32768
    done = {'a': dict(status='ok', model_size='30m', recipe='quartet', tokens_per_s=1e5,
                      tokens=5e7, wall_s=600.0, jobs=1)}  # 500 s training + 100 s fixed
    assert study.estimate_s(run, cfg, done, str(tmp_path)) == pytest.approx(100 + tokens / 1e5)
    assert study.estimate_s(run, cfg, done, str(tmp_path), jobs=2) == pytest.approx(2 * (100 + tokens / 1e5))
    # a variant's own runs before the plain recipe's (a slower optimizer, say)
    slow = study.grid(['quartet'], [0], ['30m'], [25e6], variant='root_fp4', flags=('--optimizer=root_fp4',))[0]
    done['b'] = dict(status='ok', model_size='30m', recipe='quartet', group='quartet+root_fp4', tokens_per_s=2.5e4,
                     tokens=5e7, wall_s=2100.0, jobs=1)  # 2000 s training + 100 s fixed
    assert study.estimate_s(slow, study.train_config(slow), done, str(tmp_path)) == pytest.approx(100 + tokens / 2.5e4)
    assert study.estimate_s(run, cfg, {'a': done['a']}, str(tmp_path)) == pytest.approx(100 + tokens / 1e5)
    # a new name for the same train config (root_fp4 after a code change): that config's runs
    done['b']['train_config'] = {k: v for k, v in study.train_config(slow).items() if k != 'out_dir'}
    renamed = study.grid(['quartet'], [1], ['30m'], [25e6], variant='root_fp4_new', flags=('--optimizer=root_fp4',))[0]
    assert study.estimate_s(renamed, study.train_config(renamed), done, str(tmp_path)) == pytest.approx(100 + tokens / 2.5e4)
    other = study.grid(['quartet'], [0], ['30m'], [25e6], variant='muon', flags=('--optimizer=muon',))[0]
    assert study.estimate_s(other, study.train_config(other), done, str(tmp_path)) == pytest.approx(100 + tokens / 6.25e4)
    # no study run yet: train.py's 30M result beside the study directory, plus 120 s
    with open(tmp_path / 'train_30m_quartet.json', 'w') as f:
        json.dump(dict(tokens_per_s=2e5), f)
    assert study.estimate_s(run, cfg, {}, str(tmp_path / 'study')) == pytest.approx(120 + tokens / 2e5)

# -----------------------------------------------------------------------------
# real runs of train.py on a synthetic corpus

def test_same_init_and_batches_across_recipes(tmp_path, monkeypatch):
    """What pairing by seed rests on: one seed gives every recipe the same initial weights
    and the same batches; another seed gives other ones."""
    monkeypatch.setattr(train, '_log_path', None)
    data = {'train': np.arange(5000, dtype=np.uint32) % 256}
    states, batches = {}, {}
    for recipe, seed in (('bf16', 3), ('quartet' if HAVE_FP4 else 'bf16', 3), ('bf16', 4)):
        train.setup([f'--recipe={recipe}', f'--seed={seed}', '--model_size=tiny', '--block_size=16',
                     '--batch_size=2', f'--out_dir={tmp_path}', *CPU])
        model = train.init_run(0, {'vocab_size': 256})[0]
        states[recipe, seed] = {k: v.clone() for k, v in model.state_dict().items()}
        batches[recipe, seed] = train.get_batch(data['train'], (0, 5, 0))[0]
    a, b, c = states.values()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a['lm_head.weight'], c['lm_head.weight'])
    x, y, z = batches.values()
    assert torch.equal(x, y) and not torch.equal(x, z)

@pytest.mark.skipif(not HAVE_FP4, reason='fp4.to_fp4 not available')
def test_study_end_to_end(tmp_path):
    """bf16 and nvfp4 (the cheapest FP4 recipe on a CPU) x 2 seeds in-process on a 2K-token corpus: records with curves and
    eval standard errors; train.py warns about the repeated data; the report's table, PNG."""
    corpus = str(tmp_path / 'corpus')
    os.makedirs(corpus)
    write_corpus(corpus, n=2000)
    runs = study.grid(['bf16', 'nvfp4'], [0, 1], ['tiny'], [8 * 32 * 8])  # 8 steps
    results = str(tmp_path / 'res')
    new, left = study.run_study(runs, results, [f'--data_dir={corpus}', *CPU], TINY, inprocess=True,
                                work_dir=str(tmp_path / 'work'), log=lambda m: None)
    assert len(new) == 4 and not left
    for rec in new:
        assert rec['status'] == 'ok' and rec['tokens'] == 2048 and rec['epochs'] == 2048 / 2000
        assert len(rec['curve']['train_loss']) == 8 and rec['curve']['val_steps'] == [0, 2, 4, 6, 8]
        assert 0 < rec['val_loss_se'] < 1
        assert rec['n_params'] == GPT(config_for('tiny', vocab_size=256)).get_num_params()
        assert rec['git_commit'] and rec['corpus']['train_tokens'] == 2000
        log = open(os.path.join(tmp_path, 'work', rec['id'], 'train.log')).read()
        assert 'warning: the run repeats its training data: 8 steps read 1.02 epochs' in log
    rows, fit = study.report(results, log=lambda m: None)
    assert fit is None  # one size, one budget: no law
    q = next(r for r in rows if r['group'] == 'nvfp4')
    assert q['gap']['n'] == 2 and q['gap']['rel_lo'] < q['gap']['rel'] < q['gap']['rel_hi']
    md = open(os.path.join(results, 'report.md')).read()
    assert '| tiny | 2.048K |' in md and 'Law fit: not yet' in md
    assert os.path.getsize(os.path.join(results, 'curves_tiny_2.048K.png')) > 10_000

def test_subprocess_run_and_stop(tmp_path, monkeypatch):
    """The real launcher: a train.py subprocess that finishes is recorded; one still running
    when the budget ends is stopped (its process group) and left for a later call."""
    corpus = str(tmp_path / 'corpus')
    os.makedirs(corpus)
    write_corpus(corpus, n=4000)
    kw = dict(base_flags=[f'--data_dir={corpus}', *CPU], settings=TINY, work_dir=str(tmp_path / 'w'),
              log=lambda m: None)
    new, left = study.run_study(study.grid(['bf16'], [0], ['tiny'], [8 * 32 * 3]), str(tmp_path / 'r'), **kw)
    assert len(new) == 1 and new[0]['status'] == 'ok' and new[0]['curve']['val_steps'] == [0, 1, 2, 3]
    monkeypatch.setattr(study, 'estimate_s', lambda run, cfg, records, directory, jobs: 0.0)
    long = study.grid(['bf16'], [1], ['tiny'], [8 * 32 * 100_000])
    new, left = study.run_study(long, str(tmp_path / 'r'), budget_s=2.0, **kw)
    assert not new and [r.id for r in left] == [long[0].id]
    assert not os.path.exists(os.path.join(tmp_path, 'r', long[0].id + '.json'))
