"""
Tests for sample.py and generation in model.py (KV cache, FP4 token counts). CPU, tiny models.

$ python -m pytest test_sample.py -q
"""

import os

import pytest
import torch

import sample
import train
from model import GPT, KVCache, apply_recipe, config_for, fp4_rows_padded
from test_train import HAVE_FP4, needs_fp4, write_corpus

FP4_RECIPES = [pytest.param(r, marks=needs_fp4) for r in ('quartet', 'nvfp4', 'quartet2')]

def tiny(recipe, block_size=16, seed=0, **kw):
    torch.manual_seed(seed)
    m = GPT(config_for('tiny', vocab_size=256, block_size=block_size, **kw))
    for p in m.parameters():  # larger weights than the init: peaked, position-dependent logits
        p.data.normal_(1.0 if p.dim() == 1 else 0.0, 0.1 if p.dim() == 1 else 0.08)
    return apply_recipe(m, recipe).eval()

# -----------------------------------------------------------------------------
# KV cache

@pytest.mark.parametrize('recipe', ['bf16', *FP4_RECIPES[:1]])
def test_kv_cache_gives_the_same_tokens(recipe):
    """Greedy tokens with and without the cache, also past block_size (the window slides)."""
    m = tiny(recipe, n_kv_head=1)
    idx = torch.randint(0, 256, (3, 5), generator=torch.Generator().manual_seed(1))
    cached = m.generate(idx, 24, temperature=0)  # 5 + 24 > block_size 16
    plain = m.generate(idx, 24, temperature=0, kv_cache=False)
    assert torch.equal(cached, plain), (cached != plain).nonzero()[:5]
    assert len(set(cached[:, 5:].flatten().tolist())) > 3  # not a constant output

def test_kv_cache_logits_match_the_full_forward():
    m = tiny('bf16', n_kv_head=1)
    seq = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full, _ = m(seq, seq)  # (B, T, vocab): every position
        cache = KVCache()
        steps = [m(seq[:, :6], cache=cache)[0][:, -1]]
        steps += [m(seq[:, t:t + 1], cache=cache)[0][:, -1] for t in range(6, 16)]
    assert cache.pos == 16
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 5:], rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError, match='sequence of 17 > block_size 16'):
        m(seq[:, :1], cache=cache)

def test_generate_samples_only_the_tokenizers_ids():
    """The padded head's last ids are no token: with n_vocab they are never sampled. Here the
    model is made to prefer them (their lm_head rows large), so without it they come out."""
    m = tiny('bf16')
    with torch.no_grad():
        m.lm_head.weight[200:] *= 40
    idx = torch.randint(0, 200, (4, 3), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    assert (m.generate(idx, 12)[:, 3:] >= 200).any()  # the premise: unmasked, they are sampled
    for temperature in (1.0, 0):
        torch.manual_seed(0)
        out = m.generate(idx, 12, temperature=temperature, n_vocab=200)[:, 3:]
        assert out.max() < 200, out

# -----------------------------------------------------------------------------
# FP4 layers on token counts their recipe does not divide

@pytest.mark.parametrize('recipe', FP4_RECIPES)
def test_padded_rows_come_out_as_in_a_full_batch(recipe):
    """3 rows, padded with zero rows to the recipe's multiple, against the same 3 rows
    repeated to fill the multiple: same per-row blocks, same absmax (NVFP4's tensor scale),
    so the same outputs up to the FP32 GEMM's summation order."""
    import linear
    mult = linear._dim_multiple(recipe)
    lin = linear.FP4Linear(128, 256, recipe=recipe)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match='token count'):
        lin(x)
    with torch.no_grad(), fp4_rows_padded(lin):
        y = lin(x.view(1, 3, 128))  # (1, 3, 256): the caller's shape
    with torch.no_grad():
        full = lin(x.repeat(mult // 3 + 1, 1)[:mult])  # (mult, 256), divisible as it is
    assert y.shape == (1, 3, 256)
    torch.testing.assert_close(y[0], full[:3], rtol=1e-5, atol=1e-5)
    assert not lin._forward_hooks and not lin._forward_pre_hooks  # removed afterwards
    with pytest.raises(ValueError, match='token count'):
        lin(x)

# -----------------------------------------------------------------------------
# sample.py

@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """A quartet (bf16 without fp4.py) run of 4 steps on the synthetic corpus."""
    corpus, out = tmp_path_factory.mktemp('corpus'), tmp_path_factory.mktemp('run')
    write_corpus(str(corpus))
    recipe = 'quartet' if HAVE_FP4 else 'bf16'
    train.main([f'--data_dir={corpus}', f'--out_dir={out}', '--model_size=tiny', '--block_size=32',
                '--batch_size=8', '--eval_iters=1', '--device=cpu', '--dtype=float32',
                '--compile=False', f'--recipe={recipe}', '--max_iters=4', '--eval_interval=4',
                '--sample_tokens=8'])
    return out

def test_the_training_fixture_leaves_fp32_alone(trained):
    """train.main turns TF32 on; conftest sets the session's flags back before every test, this
    module's first too (its module-scoped fixture trains before that test's own fixtures)."""
    import conftest
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    assert flags == conftest.SESSION_FLAGS

def test_sample_cli(trained, capsys, tmp_path):
    prompt = tmp_path / 'prompt.txt'
    prompt.write_text('7 38')  # the synthetic corpus has no text tokenizer: token ids
    args = [f'--out_dir={trained}', '--num_samples=2', '--max_new_tokens=12', '--device=cpu']
    texts = sample.main(args + [f'--start=FILE:{prompt}'])
    assert len(texts) == 2 and all(t.startswith('7 38 ') and len(t.split()) == 14 for t in texts)
    assert sample.main(args + ['--start=7 38']) == texts  # seeded: the same samples again
    assert sample.main(args + ['--start=7 38', '--seed=5']) != texts
    greedy = sample.main(args + ['--start=7 38', '--temperature=0'])
    assert greedy[0] == greedy[1]
    out = capsys.readouterr().out
    assert f'{trained}/ckpt.pt: step 4, recipe ' in out and '---------------' in out
    log = (trained / 'train.log').read_text()
    assert '--- a sample (8 tokens after "def "' in log and f'loss plot: {trained}/loss.png' in log

def test_sample_keeps_the_rng_stream(trained):
    m, ckpt = sample.load_model(os.path.join(trained, 'ckpt.pt'))
    torch.manual_seed(11)
    before = torch.get_rng_state()
    sample.generate_text(m, ckpt['meta'], '', 2, 5)
    assert torch.equal(torch.get_rng_state(), before)

def test_cl100k_tokenizer():
    encode, decode, eot = sample.tokenizer({'encoding': 'cl100k_base', 'vocab_size': 100277})
    text = 'def f(x):\n    return x ** 2\n'
    assert decode(encode(text)) == text and eot == 100257 and len(encode(text)) < len(text) / 2

def test_bad_checkpoints_get_one_line(trained, tmp_path):
    ckpt = torch.load(os.path.join(trained, 'ckpt.pt'), weights_only=False)
    cases = [(dict(ckpt, recipe='fullstack9'), "recipe 'fullstack9', which this code does not know"),
             ({k: v for k, v in ckpt.items() if k != 'recipe'}, "does not say which recipe trained it"),
             (dict(ckpt, model_args=dict(ckpt['model_args'], n_expert=4)), "do not fit this model.py's GPTConfig")]
    for i, (bad, expect) in enumerate(cases):
        torch.save(bad, tmp_path / f'{i}.pt')
        with pytest.raises(SystemExit, match=expect):
            sample.load_model(str(tmp_path / f'{i}.pt'))
    (tmp_path / 'cut.pt').write_bytes((trained / 'ckpt.pt').read_bytes()[:5000])
    with pytest.raises(SystemExit, match='is unreadable: truncated or corrupt'):
        sample.main([f'--ckpt_path={tmp_path}/cut.pt'])
    with pytest.raises(SystemExit, match='not found'):
        sample.main([f'--out_dir={tmp_path}/none'])

# -----------------------------------------------------------------------------
# on a GPU: the FP4 kernels, autocast, the cache (skipped without one)

@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
@pytest.mark.parametrize('recipe', ['bf16', 'quartet', 'nvfp4', 'quartet2'])
def test_generate_on_gpu(recipe):
    """Generation on a GPU with the FP4 kernels. In FP32: the cached steps' logits against the
    full forward's, and greedy tokens with and without the cache (the same, where the FP4
    forward is row by row; the NVFP4 recipes' tensor scale moves with the rows of a call, see
    sample.py, so only a bound). Under BF16 autocast, as sample.py runs: rounding differences
    between the two paths flip FP4 codes now and then, so the agreement is printed, not held."""
    m = tiny(recipe, block_size=64, n_kv_head=1).cuda()
    seq = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(5)).cuda()
    with torch.no_grad(), fp4_rows_padded(m):
        full, _ = m(seq, seq)
        cache = KVCache()
        steps = [m(seq[:, :8], cache=cache)[0][:, -1]]
        steps += [m(seq[:, t:t + 1], cache=cache)[0][:, -1] for t in range(8, 48)]
    diff = (torch.stack(steps, 1) - full[:, 7:]).abs().max().item() / full.abs().max().item()
    a = m.generate(seq[:, :8], 40, temperature=0)
    b = m.generate(seq[:, :8], 40, temperature=0, kv_cache=False)
    with torch.autocast('cuda', dtype=torch.bfloat16):
        c = m.generate(seq[:, :8], 40, temperature=0)
        d = m.generate(seq[:, :8], 40, temperature=0, kv_cache=False)
    print(f'\n{recipe:9s} FP32: max |cached - full| / max |logit| {diff:.1e}, greedy equal '
          f'{(a == b).float().mean():.0%}; BF16 autocast: greedy equal {(c == d).float().mean():.0%}')
    exact_rows = recipe in ('bf16', 'quartet')
    assert diff < (1e-4 if exact_rows else 1.0)  # NVFP4: a bound against garbage (CPU: 0.17, 0.51)
    assert torch.equal(a, b) or not exact_rows
    assert c.shape == (2, 48) and int(c.max()) < 256 and torch.isfinite(full).all()
