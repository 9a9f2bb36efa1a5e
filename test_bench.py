"""
Tests for bench.py's command line and per-operation helpers that run on a CPU (the whole-model
sections are bench_step.py's: test_bench_step.py).

$ python -m pytest test_bench.py -q
"""

import pytest

import bench


@pytest.mark.parametrize('argv', [['--sections', 'ns'], ['--sections', 'saved,states', '--states-lm', '300']])
def test_moved_sections_point_to_measure(monkeypatch, argv):
    """ns and states live in measure.py now: bench.py says so (before complaining about their options)."""
    monkeypatch.setattr('sys.argv', ['bench.py'] + argv)
    moved = argv[1].replace('saved,', '')
    with pytest.raises(SystemExit, match=f'moved to measure.py .*: python measure.py --sections {moved}$'):
        bench.main()


def test_fusion_activations_are_the_linears_inputs():
    """The fusion bound times the inputs of qkv, gate_up and down, as a block builds them."""
    import model as llama
    block = llama.Block(llama.config_for("tiny"))
    want = [block.attn.qkv.in_features, block.mlp.gate_up.in_features, block.mlp.down.in_features]
    got = bench.fusion_activations("tiny", 1000)
    assert [c for _, _, c in got] == want and [r for _, r, _ in got] == [1000] * 3
