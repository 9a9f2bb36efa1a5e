"""
Tests for bench_step.py's parts that run on a CPU: the count of what a forward saves for the
backward, by kind of layer (section 'saved'), the step rows' syntax, the profile's kernel
families (and, on a GPU, the profile itself). Tiny models, seconds.

$ python -m pytest test_bench_step.py -q
"""

from types import SimpleNamespace

import pytest
import torch

import bench_step
import fp4
import linear

ARGS = dict(model='tiny', seq=64, batch=2, step_optimizers='adamw', step_loss_chunk='0', saved_compiled=False)
M, C, H, LAYERS = 2 * 64, 128, 512, 3  # tokens, n_embd, ffn_hidden, n_layer of 'tiny'


def saved(variant, recompute='none'):
    """bench_step.section_saved's rows for one variant, {kind: row} (module types merged: all FP4 here)."""
    rows = bench_step.section_saved(SimpleNamespace(**ARGS, step_variants=variant, step_recompute=recompute))
    return {r['kind']: r for r in rows}


def graph_saved(loss, model):
    """Bytes of the distinct storages the autograd graph behind loss holds, found by walking its
    nodes (C++ nodes' _saved_* attributes, custom Functions' saved_tensors): a count that does
    not use saved_tensors_hooks. Parameters and buffers left out, as bench_step.count_saved does."""
    own = {k for t in list(model.parameters()) + list(model.buffers()) for k, _ in bench_step._storages(t)}
    # seen keeps each node's Python object alive: torch hands out one object per graph node only
    # while it lives, and a freed one's id() is reused by the next (a node then looked seen: the
    # H200 host's torch 2.11 walked only the loss's node that way)
    found, todo, seen = {}, [loss.grad_fn], {}
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        vals = list(node.saved_tensors) if hasattr(node, 'saved_tensors') else []
        for name in dir(node):
            if name.startswith('_saved_'):
                v = getattr(node, name)
                vals += list(v) if isinstance(v, (tuple, list)) else [v]
        for t in vals:
            if isinstance(t, torch.Tensor):
                found.update((k, b) for k, b in bench_step._storages(t) if k not in own)
        todo += [f for f, _ in node.next_functions]
    return sum(found.values())


@pytest.mark.parametrize('variant', ['bf16', 'quartet'])
def test_saved_by_kind_adds_up_to_the_graphs_saved_set(variant):
    """The kinds sum to the total row, column by column, and the total is what the graph holds."""
    net, cfg = bench_step._step_net(SimpleNamespace(**ARGS), variant, device='cpu')
    x, y = bench_step._step_batch(SimpleNamespace(**ARGS), cfg, 'cpu')
    rows = bench_step.saved_by_kind(net, x, y)
    kinds, total = rows[:-1], rows[-1]
    for col in bench_step.SAVED_COUNTS + ('bytes',):
        assert sum(r[col] for r in kinds) == total[col], col
    torch.manual_seed(0)
    loss = bench_step._forward_loss(net, x, y)
    assert graph_saved(loss, net) == total['bytes']
    assert {'wte', 'ln_1', 'attn.qkv', 'attn', 'attn.o', 'ln_2', 'mlp.gate_up', 'mlp.swiglu', 'mlp.down', 'ln_f',
            'lm_head', 'loss'} <= {r['kind'] for r in kinds}


def test_bf16_tail_variant_is_the_switched_model():
    """'quartet+bf16-tail': quartet's model after train.py's fp4_until switch, every block linear in
    BF16 (the step of a run's BF16 tail); a recipe without FP4 GEMMs has no such row."""
    args = SimpleNamespace(**ARGS)
    for variant, want in (('quartet', {'quartet'}), ('quartet+bf16-tail', {'bf16'}),
                          ('quartet+bf16-tail+attn-nvfp4', {'bf16'})):
        net, cfg = bench_step._step_net(args, variant, device='cpu')
        assert {m.recipe for m in net.modules() if hasattr(m, 'recipe')} == want, variant
        assert cfg.attention == ('nvfp4' if 'attn' in variant else 'bf16')
    for variant in ('bf16+bf16-tail', 'float8-rowwise+bf16-tail', 'fp8-rowwise+bf16-tail'):
        with pytest.raises(bench_step.SkipVariant, match='no FP4 GEMMs'):
            bench_step._step_net(args, variant, device='cpu')


def fp4_saved(rows, k, recipe):
    """What FP4Linear saves for the backward of a (rows, k) operand, by fp4's layout: codes (two a
    byte), one scale byte a block, the QuEST clip mask (8 a byte) for quest's operands; the FP32
    tensor scale of NVFP4 (4 bytes)."""
    r = linear.RECIPES[recipe]
    mask = rows * k // 8 if r['x'].get('scale_rule') == 'quest' else 0
    return rows * k // 2 + rows * k // fp4.FORMATS[r['fmt']] + mask, 4 if r['fmt'] == 'nvfp4' else 0


def test_saved_hand_counts():
    """Kinds whose bytes follow from the shapes: nn.Linear under BF16 autocast saves its BF16 input
    and its BF16 weight copy; FP4Linear the FP4 codes, scales (and masks) of X and W; SwiGLU
    gate_up's (M, 2H) BF16 output (gate and up are views of it) and silu(gate) (M, H)."""
    bf16 = saved('bf16')
    assert bf16['mlp.down']['bf16_bytes'] == bf16['mlp.down']['bytes'] == LAYERS * (M * H * 2 + C * H * 2)
    assert bf16['attn.o']['bytes'] == LAYERS * (M * C * 2 + C * C * 2)
    for recipe in ('quartet', 'fullstack'):
        got = saved(recipe)
        for kind, (n, k) in {'mlp.gate_up': (2 * H, C), 'mlp.down': (C, H), 'attn.o': (C, C)}.items():
            (xu8, xf32), (wu8, wf32) = fp4_saved(M, k, recipe), fp4_saved(n, k, recipe)
            assert got[kind]['u8_bytes'] == LAYERS * (xu8 + wu8), (recipe, kind)
            assert got[kind]['fp32_bytes'] == LAYERS * (xf32 + wf32) and got[kind]['bf16_bytes'] == 0, (recipe, kind)
        assert got['mlp.swiglu']['bytes'] == got['mlp.swiglu']['bf16_bytes'] == LAYERS * (M * 2 * H * 2 + M * H * 2)


@pytest.mark.parametrize('variant', ['bf16', 'quartet'])
def test_recompute_mlp_cuts_what_the_mlp_saves(variant):
    """recompute='mlp': ln_2, gate_up and SwiGLU save nothing; the block keeps its input x, the
    (B, T, C) FP32 residual stream, which ln_2 saved anyway (so it moves, not grows); the
    rest is unchanged. The drop, by hand: SwiGLU's M x 3H x 2 bytes, gate_up's saved inputs, ln_2's
    normalized x (M x C x 4) and 1/rms (M x 4), a layer."""
    plain, cut = saved(variant), saved(variant, 'mlp')
    assert {'ln_2', 'mlp.gate_up', 'mlp.swiglu'} & set(cut) == set()
    assert cut['block']['bytes'] == cut['block']['fp32_bytes'] == LAYERS * M * C * 4
    for kind in set(plain) - {'ln_2', 'mlp.gate_up', 'mlp.swiglu', 'total (eager)'}:
        assert cut[kind]['bytes'] == plain[kind]['bytes'], kind
    if variant == 'bf16':  # nn.Linear: its BF16 input (M, C) and weight copy (2H, C)
        gate_up = M * C * 2 + 2 * H * C * 2
    else:
        gate_up = sum(fp4_saved(M, C, variant)) + sum(fp4_saved(2 * H, C, variant))
    ln_2 = M * C * 4 + M * 4
    drop = plain['total (eager)']['bytes'] - cut['total (eager)']['bytes']
    assert drop == LAYERS * (M * 3 * H * 2 + gate_up + ln_2)


def test_step_combos():
    """'name:optimizer:loss_chunk:recompute[:accumulation]' is one row; plain names take every list's values."""
    assert bench_step.step_combos('bf16,quartet:adamw_fp4:4096:mlp', 'adamw', '0,4096', 'none,mlp') == [
        ('bf16', 'adamw', 0, 'none', 1), ('bf16', 'adamw', 0, 'mlp', 1), ('bf16', 'adamw', 4096, 'none', 1),
        ('bf16', 'adamw', 4096, 'mlp', 1), ('quartet', 'adamw_fp4', 4096, 'mlp', 1)]
    assert bench_step.step_combos('quartet:root', 'adamw', '0', 'mlp') == [('quartet', 'root', 0, 'mlp', 1)]
    assert bench_step.step_combos('bf16,fullstack:root_fp4:4096:mlp:32', 'adamw', '0', 'none', '1,32') == [
        ('bf16', 'adamw', 0, 'none', 1), ('bf16', 'adamw', 0, 'none', 32), ('fullstack', 'root_fp4', 4096, 'mlp', 32)]
    with pytest.raises(SystemExit, match="recompute 'qkv' is not one of none, mlp"):
        bench_step.step_combos('quartet:adamw:0:qkv', 'adamw', '0')
    with pytest.raises(SystemExit, match='accumulation must be a whole number >= 1'):
        bench_step.step_combos('quartet:adamw:0:mlp:x', 'adamw', '0')
    with pytest.raises(SystemExit, match='name:optimizer:loss_chunk:recompute:accumulation'):
        bench_step.step_combos('quartet:adamw:0:mlp:1:2', 'adamw', '0')


@pytest.mark.parametrize('variant', ['bf16', 'quartet'])
def test_attention_does_not_keep_qkvs_output(variant):
    """Attention saves q and k (new tensors after RoPE), a copy of v, its output and lse: never
    the fused qkv linear's (M, 3C) output, which a v that stayed a view of it would keep alive
    (2C BF16 values a token a layer more: 2 GiB at 1B)."""
    net, cfg = bench_step._step_net(SimpleNamespace(**ARGS), variant, device='cpu')
    x, y = bench_step._step_batch(SimpleNamespace(**ARGS), cfg, 'cpu')
    loss, found = bench_step.count_saved(lambda: bench_step._forward_loss(net, x, y), net)
    names = {m: n for n, m in net.named_modules()}
    attn = [(t.shape, nbytes) for mod, t, nbytes in found.values() if bench_step.saved_kind(names[mod]) == 'attn']
    assert attn and all(nbytes < M * 3 * C * 2 for _, nbytes in attn), attn
    # q, k, v, out (M, C) each, and apply_rope's BF16 cos and sin (T, hs / 2), cast for q and for k
    t, hs = ARGS['seq'], C // cfg.n_head
    assert saved(variant)['attn']['bf16_bytes'] == LAYERS * (4 * M * C * 2 + 4 * t * hs // 2 * 2)


def test_kernel_families():
    names = {  # profiler names as torch 2.11 gives them on the H200 (results/nvidia-h200/step/bench_step_profile_30m.json)
        'void quant_cols<1, 128, true, 0, 2>(void const*, unsigned char const*, float const*, unsig': 'fp4 (kernels.cu)',
        'void quant_rows_fold<1, 1, 0>(void const*, unsigned int': 'fp4 (kernels.cu)',
        '_bwd_dkdv_kernel': 'fp4 attention (Triton)',
        'nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_TNT': 'GEMMs (cuBLAS, CUTLASS)',
        'triton_red_fused__softmax__to_copy_0': 'inductor (Triton)',
        'void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native:': 'other',
    }
    assert {n: bench_step.kernel_family(n) for n in names} == names


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
def test_step_profile_on_gpu():
    """bench_step.py --sections step_profile: per row the step's time, the GPU's busy share and its
    heaviest kernels (tiny model: the host, not the GPU, bounds it)."""
    rows = bench_step.section_step_profile(SimpleNamespace(**ARGS, step_variants='bf16,quartet', step_recompute='none',
                                                      step_reps=2, compile_mode='default'))
    assert [r['variant'] for r in rows] == ['bf16', 'quartet']
    for r in rows:
        ms = [k['ms'] for k in r['top_kernels']]
        assert 0 < r['gpu_busy_ms'] < 1.5 * r['ms'] and ms == sorted(ms, reverse=True) and ms[0] > 0, r
        # the families partition the same kernels: equal but for rounding each value to 0.01 ms
        fam = r['family_ms'].values()
        assert abs(sum(fam) - r['gpu_busy_ms']) <= 0.005 * (len(fam) + 1) + 1e-9, r
    assert rows[1]['family_ms'].get('fp4 (kernels.cu)', 0) > 0  # quartet's quantizations, found by name
