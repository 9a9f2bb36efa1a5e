"""
Tests for the precision schedule: train.py's fp4_until (the block linears' FP4 GEMMs before step
s = round(fp4_until * max_iters), BF16 from it: model.fp4_switch_step, model.to_bf16_gemms,
checkpoint.bf16_from) and checkpoint_steps, the branch points study.py starts BF16 tails from.
CPU: tiny quartet runs on test_train.py's synthetic corpus, a few steps each.

$ python -m pytest test_schedule.py -q
"""

import importlib.util
import os
import re

import pytest
import torch

import checkpoint
import configurator
import model as model_py
import train
from model import GPT, apply_recipe, config_for
from test_train import corpus, fails, needs_fp4, run  # noqa: F401 (corpus: the module-scoped fixture)

SCHEDULE = ['--recipe=quartet', '--max_iters=4', '--eval_interval=1', '--eval_iters=1', '--batch_size=4',
            '--keep_checkpoints=4', '--sample_tokens=0']

@pytest.fixture(scope='module')
def schedule_runs(corpus, tmp_path_factory):
    """Two quartet runs of 4 steps, checkpoints at every eval (1, 2, 3, 4) kept: FP4 to the end,
    and fp4_until=0.5 (BF16 from step 2). {name: (out_dir, summary)}."""
    out = {}
    for name, until in (('fp4', 1.0), ('tail', 0.5)):
        path = tmp_path_factory.mktemp(name)
        out[name] = path, run(corpus, path, *SCHEDULE, f'--fp4_until={until}')
    return out

def bf16_continuation(src, dst):
    """src (an FP4 run's checkpoint) as a recipe='bf16' run's checkpoint: plain nn.Linear block
    linears (model.apply_recipe), the same weights, optimizer state, RNGs and step. Resuming it is
    BF16 training from there, by the code path of a bf16 run, not of fp4_until."""
    ckpt = torch.load(src, weights_only=False)
    ckpt['recipe'] = ckpt['config']['recipe'] = 'bf16'
    os.makedirs(dst, exist_ok=True)
    torch.save(ckpt, os.path.join(dst, 'ckpt.pt'))
    return dst

@needs_fp4
def test_fp4_until_switches_at_the_stated_step(corpus, tmp_path, schedule_runs):
    """Steps 0-1 equal the FP4 run's bit for bit, step 2 on (s = round(0.5 * 4) = 2) a BF16
    continuation's of the FP4 run's step-2 checkpoint: weights, optimizer state, data order and lr
    schedule carried over unchanged. The eval at step 2 is still FP4's, those at 3 and 4 BF16's."""
    (fp4_dir, fp4), (tail_dir, tail) = schedule_runs['fp4'], schedule_runs['tail']
    a, b = fp4['loss_curve'], tail['loss_curve']
    assert b['train_loss'][:2] == a['train_loss'][:2] and b['train_loss'][2] != a['train_loss'][2]
    assert b['val_loss'][:3] == a['val_loss'][:3] and b['val_loss'][3:] != a['val_loss'][3:]  # evals at 0, 1, 2 | 3, 4
    assert b['bf16_from'] == tail['bf16_from'] == 2 and 'bf16_from' not in a and fp4['bf16_from'] is None
    assert 'step 2: fp4_until=0.5: 12 block linears run BF16 from here' in (tail_dir / 'train.log').read_text()
    bf16 = run(corpus, bf16_continuation(fp4_dir / 'ckpt.2.pt', tmp_path / 'bf16'), '--resume=True',
               *[f for f in SCHEDULE if not f.startswith('--recipe')])['loss_curve']
    assert b['train_loss'][2:] == bf16['train_loss'][2:] and b['val_loss'][3:] == bf16['val_loss'][3:]
    for step in (2, 3):  # the checkpoint records the switch: from step 3 on, not at 2 (saved before it)
        ckpt = torch.load(tail_dir / f'ckpt.{step}.pt', weights_only=False)
        assert ckpt['history'].get('bf16_from') == (None if step == 2 else 2)
    import sample  # sample.py runs a switched checkpoint's linears as it trained them last: BF16
    recipes = {m.recipe for m in sample.load_model(tail_dir / 'ckpt.3.pt')[0].modules() if hasattr(m, 'recipe')}
    assert recipes == {'bf16'}

@needs_fp4
@pytest.mark.parametrize('step,flags', [(1, ['--fp4_until=0.5']), (3, ['--fp4_until=0.5']), (3, []),
                                        (2, ['--fp4_until=0.5'])])
def test_fp4_until_resumes_across_the_switch(corpus, tmp_path, schedule_runs, step, flags):
    """A checkpoint before the switch (1) and one after it (3) resume to the uninterrupted run's
    losses; after it the run stays BF16 with or without the flag (the checkpoint's fp4_until). The
    FP4 run's checkpoint at the switch step, resumed with fp4_until, is the same run too: a branch
    (study.py starts BF16 tails there)."""
    src = schedule_runs['fp4' if step == 2 else 'tail'][0] / f'ckpt.{step}.pt'
    s = run(corpus, tmp_path, *SCHEDULE, f'--resume_from={src}', *flags)
    want = schedule_runs['tail'][1]['loss_curve']
    assert s['loss_curve']['train_loss'] == want['train_loss'] and s['loss_curve']['val_loss'] == want['val_loss']
    assert s['bf16_from'] == 2

@needs_fp4
def test_fp4_until_resume_refuses_another_switch(corpus, tmp_path, schedule_runs):
    """A resume whose switch step contradicts what its checkpoint trained stops in one line."""
    after = schedule_runs['tail'][0] / 'ckpt.3.pt'
    msg = fails(corpus, tmp_path, *SCHEDULE, f'--resume_from={after}', '--fp4_until=1.0')
    assert 'switched the block linears to BF16 at step 2, but fp4_until=1.0 switches at step 4' in msg
    assert '--fp4_until=0.5' in msg
    fp4_past = schedule_runs['fp4'][0] / 'ckpt.3.pt'
    msg = fails(corpus, tmp_path, *SCHEDULE, f'--resume_from={fp4_past}', '--fp4_until=0.5')
    assert 'ran FP4 GEMMs through step 2, past step 2 where fp4_until=0.5 switches' in msg and '>= 0.75' in msg

@needs_fp4
def test_checkpoint_steps_branch_points(corpus, tmp_path, schedule_runs):
    """checkpoint_steps saves before those steps with or without evals there, and changes no loss."""
    s = run(corpus, tmp_path, *SCHEDULE, '--always_save_checkpoint=False', '--checkpoint_steps=1,3', '--eval_interval=4')
    assert s['loss_curve']['train_loss'] == schedule_runs['fp4'][1]['loss_curve']['train_loss']
    assert sorted(p.name for p in tmp_path.glob('ckpt*')) == ['ckpt.1.pt', 'ckpt.pt']
    assert checkpoint.at_step(tmp_path, 1) == str(tmp_path / 'ckpt.1.pt')
    assert checkpoint.at_step(tmp_path, 3) == str(tmp_path / 'ckpt.pt') and checkpoint.at_step(tmp_path, 2) is None

@needs_fp4
def test_fp4_until_recompiles_once_under_compile():
    """The switch changes each FP4Linear's recipe attribute: under torch.compile one guard fails
    and the model is traced once more, then the BF16 graph is reused; no graph breaks. (Dynamo
    with a counting backend: the guards and graphs are inductor's too, without its compile time.)"""
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    m = apply_recipe(GPT(config_for('tiny', vocab_size=256, block_size=32)), 'quartet')
    compiled, graphs = torch.compile(m, backend=(cnt := CompileCounter())), []
    x, y = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
    for step in range(4):
        if step == 2:
            assert model_py.to_bf16_gemms(m) == 12
        compiled(x, y)[1].backward()
        graphs.append(cnt.frame_count)
    assert graphs == [1, 1, 2, 2] and not counters['graph_break'], (graphs, dict(counters['graph_break']))
    torch._dynamo.reset()

def test_fp4_until_config_rule(corpus, tmp_path):
    """Where fp4_until cannot apply, check_config refuses it in one line before any data is read."""
    nodata = [f'--out_dir={tmp_path}', '--data_dir=/nonexistent', '--max_iters=10']
    for args, why in ((['--recipe=bf16'], "recipe 'bf16' runs no FP4 GEMMs to switch"),
                      (['--recipe=float8'], "recipe 'float8' runs no FP4 GEMMs to switch"),
                      (['--fp4_until=0.01'], 'round(0.01 * 10) = 0, BF16 from it) cannot apply: it leaves no FP4 step'),
                      (['--fp4_until=0.96'], 'round(0.96 * 10) = 10, BF16 from it) cannot apply: it leaves no BF16 step')):
        if '--recipe=float8' in args and importlib.util.find_spec('torchao') is None:
            continue  # checked first: torchao is missing
        with pytest.raises(configurator.ConfigError, match=re.escape(why)):
            train.main([*nodata, '--fp4_until=0.9', *args])
    for bad in ('0', '1.5', '-0.1'):
        with pytest.raises(configurator.ConfigError, match=f'fp4_until={float(bad)}: must be a finite float > 0 and <= 1'):
            train.main([*nodata, f'--fp4_until={bad}'])
    with pytest.raises(configurator.ConfigError, match="checkpoint_steps='3;5': must be steps, comma-separated"):
        train.main([*nodata, '--checkpoint_steps=3;5'])
    # the CPU refuses cuda_graph=True before this rule: the rule itself
    assert 'cuda_graph=True replays graphs captured with the FP4 kernels' in model_py.schedule_problem(0.9, 10, 'quartet', True)
    assert model_py.schedule_problem(1.0, 10, 'bf16', True) is None  # FP4 to the end: nothing to refuse
