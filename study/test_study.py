"""
Tests for study.py (and the two train.py pieces it reads: the eval standard error and the
repeated-data warning). CPU: a fake launcher for the resume logic and tiny real runs on a
synthetic corpus; the statistics, the law fit and the report are test_analysis.py's.

$ python -m pytest study/test_study.py -q
"""

import json
import os
import subprocess

import numpy as np
import pytest
import torch

import analysis
import runlog
import study
import train
from model import GPT, config_for, fp4_switch_step
from test_train import write_corpus

try:
    import linear
    HAVE_FP4 = hasattr(linear, 'to_fp4')
except ImportError:
    HAVE_FP4 = False

CPU = ['--device=cpu', '--dtype=float32', '--compile=False', '--learning_rate=0.01']
TINY = dict(block_size=32, batch_size=8, gradient_accumulation_steps=1, eval_iters=4,
            always_save_checkpoint=False, log_interval=5, sample_tokens=0)  # no closing sample: none is read

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

def test_merge_adds_new_runs_and_keeps_reruns_apart(tmp_path):
    """study.py merge: a bundle's runs not in the results are added; one there is never replaced;
    the same id with other content (a rerun) goes to <results>_repeats/ once, however often
    merged; a JSON that is not a run record is an error naming it."""
    import tarfile
    res, machine = str(tmp_path / 'study'), str(tmp_path / 'machine' / 'study')
    os.makedirs(res)
    os.makedirs(machine)
    def rec(run_id, loss):
        return dict(id=run_id, status='ok', val_loss=loss, val_loss_split=loss - 0.1, device='cpu')
    study.write_json(os.path.join(res, 'a.json'), rec('a', 3.0))
    study.write_json(os.path.join(res, 'b.json'), rec('b', 3.2))
    for r in (rec('a', 3.0), rec('b', 3.3), rec('c', 2.9)):  # a: the same; b: a rerun; c: new
        study.write_json(os.path.join(machine, r['id'] + '.json'), r)
    study.write_json(os.path.join(machine, 'report.json'), dict(tables=[]))  # not a run: ignored
    bundle = str(tmp_path / 'study.tgz')
    study.write_bundle(machine, bundle)
    logs = []
    assert study.merge([bundle], res, log=logs.append) == (['c'], ['a'], ['b'])
    assert study.load_records(res) == {'a': rec('a', 3.0), 'b': rec('b', 3.2), 'c': rec('c', 2.9)}
    with open(os.path.join(res + '_repeats', 'b.1.json')) as f:
        assert json.load(f) == rec('b', 3.3)
    assert 'val loss 3.1000 recorded, 3.2000 rerun (+3.23%)' in logs[0]
    assert study.merge([bundle, bundle], res, log=logs.append) == ([], ['a', 'b', 'c'], [])
    assert sorted(os.listdir(res + '_repeats')) == ['b.1.json']
    study.write_json(os.path.join(machine, 'b.json'), rec('b', 3.4))  # a second, other rerun
    study.write_bundle(machine, bundle)
    assert study.merge([bundle], res, log=logs.append)[2] == ['b']
    assert sorted(os.listdir(res + '_repeats')) == ['b.1.json', 'b.2.json']
    with open(os.path.join(machine, 'd.json'), 'w') as f:
        json.dump(dict(id='other'), f)  # the file's name is not its id
    study.write_bundle(machine, bundle)
    with pytest.raises(ValueError, match='d.json is not a study run record'):
        study.merge([bundle], res, log=logs.append)
    with tarfile.open(bundle) as tar:
        assert 'study/c.json' in tar.getnames()

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
    # a config no run has: the recipe's fastest run (sharing the GPU only slows a run down)
    other = study.grid(['quartet'], [0], ['30m'], [25e6], variant='muon', flags=('--optimizer=muon',))[0]
    assert study.estimate_s(other, study.train_config(other), done, str(tmp_path)) == pytest.approx(100 + tokens / 1e5)
    # of two runs of one config, the faster (the other shared the GPU): tokens/s is a bound from below
    done['c'] = dict(done['a'], tokens_per_s=5e4, wall_s=1100.0)  # 1000 s training + 100 s fixed
    assert study.estimate_s(run, cfg, done, str(tmp_path)) == pytest.approx(100 + tokens / 1e5)
    # a run that had the GPU to itself before faster-looking ones of unknown sharing
    alone = {'a': done['a'], 'd': dict(done['a'], tokens_per_s=8e4, wall_s=725.0, gpu_processes=1)}
    assert study.estimate_s(run, cfg, alone, str(tmp_path)) == pytest.approx(100 + tokens / 8e4)
    # a size the recipe has not run: its runs at 30m scaled by FLOPs a token
    big = study.grid(['quartet'], [0], ['100m'], [25e6])[0]
    ratio = study.flops_per_token('100m', 512) / study.flops_per_token('30m', 512)
    assert 2 < ratio < 4
    assert study.estimate_s(big, study.train_config(big), {'a': done['a']}, str(tmp_path)) == pytest.approx(
        100 + tokens / (1e5 / ratio))
    # no study run yet: train.py's 30M result beside the study directory, plus 120 s
    with open(tmp_path / 'train_30m_quartet.json', 'w') as f:
        json.dump(dict(tokens_per_s=2e5), f)
    assert study.estimate_s(run, cfg, {}, str(tmp_path / 'study')) == pytest.approx(120 + tokens / 2e5)

# -----------------------------------------------------------------------------
# BF16 tails: branched from their FP4 run's checkpoint at the switch step

def test_grid_with_tails():
    runs = study.grid(['bf16', 'float8', 'quartet'], [0, 1], ['30m'], [50e6], tails=[0.1, 0.2])
    assert [r.id for r in runs[:5]] == ['30m-50M-bf16-s0', '30m-50M-float8-s0', '30m-50M-quartet-s0',
                                        '30m-50M-quartet-tail10-s0', '30m-50M-quartet-tail20-s0']  # no FP4 GEMMs: no tails
    assert len(runs) == 10 and runs[5].id == '30m-50M-bf16-s1'  # seed-major, the tails after their FP4 run
    tail = runs[3]
    assert tail.group == 'quartet+tail10' and tail.parent == runs[2] and runs[2].parent is None
    assert tail.train_flags == ('--fp4_until=0.9',) and runs[4].train_flags == ('--fp4_until=0.8',)
    cfg = study.train_config(tail)
    assert cfg['fp4_until'] == 0.9 and fp4_switch_step(0.9, cfg['max_iters']) == round(0.9 * 1526) == 1373
    var = study.grid(['quartet'], [0], ['30m'], [50e6], 'adamw_fp4', ['--optimizer=adamw_fp4'], tails=[0.2])
    assert [r.id for r in var] == ['30m-50M-quartet-adamw_fp4-s0', '30m-50M-quartet-tail20_adamw_fp4-s0']
    assert var[1].train_flags == ('--optimizer=adamw_fp4', '--fp4_until=0.8') and var[1].parent == var[0]
    for bad in (0.125, 1.0, 0.0):
        with pytest.raises(ValueError, match='whole percent'):
            study.grid(['quartet'], [0], ['30m'], [50e6], tails=[bad])
    with pytest.raises(ValueError, match='cannot also be a flag'):
        study.grid(['quartet'], [0], ['30m'], [50e6], 'x', ['--fp4_until=0.5'], tails=[0.1])
    assert study.main(['plan', '--recipes=bf16,float8,quartet,nvfp4', '--tails=0.1,0.2', '--seeds=0,1,2',
                       '--sizes=30m', '--tokens=50e6', '--results=/nonexistent/study']) == 0

def fake_branching_start(outcomes=None):
    """fake_start, and like train.py an FP4 run leaves a checkpoint (its iter_num and config) at each of
    its checkpoint_steps: the older ones as ckpt.<step>.pt, the last as ckpt.pt. Returns the configs."""
    start, _ = fake_start(outcomes or {})
    configs = {}

    def branching(run, cfg, inprocess):
        configs[run.id] = dict(cfg)
        steps = [int(s) for s in cfg.get('checkpoint_steps', '').split(',') if s]
        os.makedirs(cfg['out_dir'], exist_ok=True)
        for i, step in enumerate(steps):
            name = 'ckpt.pt' if i == len(steps) - 1 else f'ckpt.{step}.pt'
            torch.save(dict(iter_num=step, config={**train.DEFAULTS, **cfg}), os.path.join(cfg['out_dir'], name))
        return start(run, cfg, inprocess)
    return branching, configs

def test_tails_branch_from_their_fp4_runs_checkpoint(tmp_path, monkeypatch, no_corpus):
    """Each tail starts once its FP4 run is recorded, from that run's checkpoint at its switch step
    (which the FP4 run's config asked for), trains only its tail, and the checkpoint goes once the
    tail is recorded. Without the checkpoint (the FP4 run recorded before), a tail runs whole; with
    one of another config too; a tail whose FP4 run failed waits for a later call."""
    results, work, logs = str(tmp_path / 'res'), str(tmp_path / 'work'), []
    kw = dict(settings=TINY, work_dir=work, log=logs.append)
    runs = study.grid(['bf16', 'quartet'], [0], ['tiny'], [1e4], tails=[0.25, 0.5])  # 39 steps: s 29, 20 (19.5: to even)
    start, configs = fake_branching_start()
    monkeypatch.setattr(study, 'start', start)
    new, left = study.run_study(runs, results, jobs=2, **kw)  # the tails wait for their FP4 run, not for a slot
    assert list(configs) == [r.id for r in runs] and not left
    parent = os.path.join(work, 'tiny-10K-quartet-s0')
    fp4 = configs['tiny-10K-quartet-s0']
    assert fp4['checkpoint_steps'] == '20,29' and fp4['keep_checkpoints'] == 2
    assert 'checkpoint_steps' not in configs['tiny-10K-bf16-s0']
    assert configs['tiny-10K-quartet-tail25-s0']['resume_from'] == os.path.join(parent, 'ckpt.pt')
    assert configs['tiny-10K-quartet-tail50-s0']['resume_from'] == os.path.join(parent, 'ckpt.20.pt')
    assert not [f for f in os.listdir(parent) if f.startswith('ckpt')]  # each served its tail: deleted
    recs = study.load_records(results)
    tail = recs['tiny-10K-quartet-tail25-s0']
    assert tail['branched_from'] == dict(id='tiny-10K-quartet-s0', step=29) and tail['tokens_run'] == 10 * 256
    assert tail['tokens'] == 39 * 256 and tail['flags'] == ['--fp4_until=0.75'] and tail['group'] == 'quartet+tail25'
    assert 'resume_from' not in tail['train_config'] and tail['train_config']['fp4_until'] == 0.75
    assert recs['tiny-10K-quartet-s0']['branched_from'] is None
    # no checkpoint left: the tail runs whole (the same run), and says why
    os.remove(os.path.join(results, 'tiny-10K-quartet-tail25-s0.json'))
    configs.clear()
    study.run_study(runs, results, **kw)
    assert list(configs) == ['tiny-10K-quartet-tail25-s0'] and 'resume_from' not in configs['tiny-10K-quartet-tail25-s0']
    assert any('no checkpoint of tiny-10K-quartet-s0 at step 29' in m for m in logs)
    assert study.load_records(results)['tiny-10K-quartet-tail25-s0']['branched_from'] is None
    # a checkpoint of another config (the study's settings changed since): whole again
    torch.save(dict(iter_num=29, config={**train.DEFAULTS, **fp4, 'learning_rate': 0.5}), os.path.join(parent, 'ckpt.pt'))
    os.remove(os.path.join(results, 'tiny-10K-quartet-tail25-s0.json'))
    configs.clear()
    study.run_study(runs, results, **kw)
    assert 'resume_from' not in configs['tiny-10K-quartet-tail25-s0']
    assert any('was trained with other learning_rate: it runs whole' in m for m in logs)
    # the FP4 run fails: its tails are left for a later call, not run whole
    start, configs = fake_branching_start({'tiny-10K-quartet-s1': 'fail'})
    monkeypatch.setattr(study, 'start', start)
    runs1 = study.grid(['quartet'], [1], ['tiny'], [1e4], tails=[0.25])
    new, left = study.run_study(runs1, results, **kw)
    assert list(configs) == ['tiny-10K-quartet-s1'] and [r.id for r in left] == [r.id for r in runs1]
    assert 'skip tiny-10K-quartet-tail25-s1: its FP4 run tiny-10K-quartet-s1 is not done' in logs

def test_tail_estimate_counts_only_its_tail(tmp_path):
    tail = study.grid(['quartet'], [0], ['30m'], [25e6], tails=[0.2])[1]
    cfg = study.train_config(tail)  # 763 steps; the switch at round(0.8 * 763) = 610
    done = {'a': dict(status='ok', model_size='30m', recipe='quartet', tokens_per_s=1e5, tokens=5e7, wall_s=600.0, jobs=1)}
    assert study.estimate_s(tail, cfg, done, str(tmp_path)) == pytest.approx(100 + 763 * 32768 / 1e5)
    branched = dict(cfg, resume_from='ckpt.pt')
    assert study.estimate_s(tail, branched, done, str(tmp_path)) == pytest.approx(100 + (763 - 610) * 32768 / 1e5)
    # a branched tail's record: its fixed cost from the tokens it trained, not the whole run's
    done = {'t': dict(done['a'], group='quartet+tail20', tokens_run=153 * 32768, wall_s=100 + 153 * 32768 / 1e5)}
    assert study.estimate_s(tail, branched, done, str(tmp_path)) == pytest.approx(100 + 153 * 32768 / 1e5)

# -----------------------------------------------------------------------------
# real runs of train.py on a synthetic corpus

def test_gpu_processes_counts_nvidia_smi_lines(monkeypatch):
    def fake(lines, rc=0):
        return lambda *a, **k: subprocess.CompletedProcess(a, rc, stdout=lines, stderr='')
    monkeypatch.setattr(study.subprocess, 'run', fake('1234\n5678\n'))
    assert study.gpu_processes() == 2
    monkeypatch.setattr(study.subprocess, 'run', fake(''))
    assert study.gpu_processes() == 0
    monkeypatch.setattr(study.subprocess, 'run', fake('', rc=9))  # no driver
    assert study.gpu_processes() is None

    def missing(*a, **k):
        raise FileNotFoundError('nvidia-smi')
    monkeypatch.setattr(study.subprocess, 'run', missing)
    assert study.gpu_processes() is None

def test_same_init_and_batches_across_recipes(tmp_path, monkeypatch):
    """What pairing by seed rests on: one seed gives every recipe the same initial weights
    and the same batches; another seed gives other ones."""
    monkeypatch.setattr(runlog, '_path', None)
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

@pytest.mark.skipif(not HAVE_FP4, reason='linear.to_fp4 not available')
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
        resolved = rec['resolved_config']  # train.py's defaults too, as the run had them
        assert resolved['recipe'] == rec['recipe'] and resolved['max_iters'] == 8
        assert resolved['lora_refit_first'] == train.lora_refit_first and 'lora_refit_first' not in rec['train_config']
        log = open(os.path.join(tmp_path, 'work', rec['id'], 'train.log')).read()
        assert 'warning: the run repeats its training data: 8 steps read 1.02 epochs' in log
    rows, fit = analysis.report(results, log=lambda m: None)
    assert fit is None  # one size, one budget: no law
    q = next(r for r in rows if r['group'] == 'nvfp4')
    assert q['gap']['n'] == 2 and q['gap']['rel_lo'] < q['gap']['rel'] < q['gap']['rel_hi']
    md = open(os.path.join(results, 'report.md')).read()
    assert '| tiny | 2.048K |' in md and 'Law fit: not yet' in md
    assert os.path.getsize(os.path.join(results, 'curves_tiny_2.048K.png')) > 10_000

@pytest.mark.skipif(not HAVE_FP4, reason='fp4.to_fp4 not available')
def test_branched_tail_is_the_whole_tail_run(tmp_path):
    """nvfp4 with BF16 over its last 2 of 8 steps (round(0.75 * 8) = 6), in-process: branched from the
    FP4 run's step-6 checkpoint it records the same curve and split loss, bit for bit, as run whole
    (no FP4 run to branch from); the report compares it with bf16 and with plain nvfp4."""
    corpus = str(tmp_path / 'corpus')
    os.makedirs(corpus)
    write_corpus(corpus, n=4000)
    flags = [f'--data_dir={corpus}', *CPU]
    settings = dict(TINY, eval_iters=1, eval_split_tokens=256)
    runs = study.grid(['bf16', 'nvfp4'], [1], ['tiny'], [8 * 32 * 8], tails=[0.25])
    results = str(tmp_path / 'res')
    new, left = study.run_study(runs, results, flags, settings, inprocess=True, work_dir=str(tmp_path / 'w'),
                                log=lambda m: None)
    assert len(new) == 3 and not left
    recs = study.load_records(results)
    branched = recs['tiny-2.048K-nvfp4-tail25-s1']
    fp4 = recs['tiny-2.048K-nvfp4-s1']
    assert branched['branched_from'] == dict(id=fp4['id'], step=6) and branched['tokens_run'] == 2 * 256
    assert branched['curve']['bf16_from'] == 6 and branched['curve']['train_loss'][:6] == fp4['curve']['train_loss'][:6]
    assert branched['curve']['train_loss'][6:] != fp4['curve']['train_loss'][6:]
    whole, _ = study.run_study([study.Run('tiny', 8 * 32 * 8, 'nvfp4', 1, tail=0.25)], str(tmp_path / 'res2'), flags,
                               settings, inprocess=True, work_dir=str(tmp_path / 'w2'), log=lambda m: None)
    assert whole[0]['branched_from'] is None
    for key in ('curve', 'val_loss', 'val_loss_split', 'train_config'):
        assert whole[0][key] == branched[key], key
    rows, _ = analysis.report(results, log=lambda m: None)
    row = next(r for r in rows if r['group'] == 'nvfp4+tail25')
    assert row['ref'] == 'bf16' and row['base'] == 'nvfp4'

def test_subprocess_run_and_stop(tmp_path, monkeypatch):
    """The real launcher: a train.py subprocess that finishes is recorded; one still running
    when the budget ends is stopped (its process group) and left for a later call."""
    corpus = str(tmp_path / 'corpus')
    os.makedirs(corpus)
    write_corpus(corpus, n=4000)
    kw = dict(base_flags=[f'--data_dir={corpus}', *CPU], settings=TINY, work_dir=str(tmp_path / 'w'),
              log=lambda m: None)
    counts = iter([0, 2, 1])  # the GPU's processes at each poll, then 1 for good
    monkeypatch.setattr(study, 'gpu_processes', lambda: next(counts, 1))
    monkeypatch.setattr(study, 'SHARING_POLL_S', 0.0)
    new, left = study.run_study(study.grid(['bf16'], [0], ['tiny'], [8 * 32 * 3]), str(tmp_path / 'r'), **kw)
    assert len(new) == 1 and new[0]['status'] == 'ok' and new[0]['curve']['val_steps'] == [0, 1, 2, 3]
    assert new[0]['gpu_processes'] == 2  # the most it saw while the run went
    monkeypatch.setattr(study, 'estimate_s', lambda run, cfg, records, directory, jobs: 0.0)
    long = study.grid(['bf16'], [1], ['tiny'], [8 * 32 * 100_000])
    new, left = study.run_study(long, str(tmp_path / 'r'), budget_s=2.0, **kw)
    assert not new and [r.id for r in left] == [long[0].id]
    assert not os.path.exists(os.path.join(tmp_path, 'r', long[0].id + '.json'))
