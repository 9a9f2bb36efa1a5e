"""
Tests for bench_ops.py's per-operation helpers that run on a CPU (the whole-model sections are
bench_step.py's: test_bench_step.py; the command line is bench.py's: test_bench.py).

$ python -m pytest test_bench_ops.py -q
"""

import bench_ops


def test_fusion_activations_are_the_linears_inputs():
    """The fusion bound times the inputs of qkv, gate_up and down, as a block builds them."""
    import model as llama
    block = llama.Block(llama.config_for("tiny"))
    want = [block.attn.qkv.in_features, block.mlp.gate_up.in_features, block.mlp.down.in_features]
    got = bench_ops.fusion_activations("tiny", 1000)
    assert [c for _, _, c in got] == want and [r for _, r, _ in got] == [1000] * 3


def test_gemm_shapes_are_the_linears_three_gemms():
    """The gemm section times forward, dgrad and wgrad of each 1B linear: (M, N, K) from (in, out)."""
    shapes = {name: dims for name, *dims in bench_ops.gemm_shapes(16384)}
    assert len(shapes) == 12
    assert shapes["qkv fwd"] == [16384, 6144, 2048] and shapes["down dgrad"] == [16384, 5632, 2048]
    assert shapes["gate_up wgrad"] == [11264, 2048, 16384]
