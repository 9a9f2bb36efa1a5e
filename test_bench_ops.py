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
