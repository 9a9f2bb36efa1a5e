"""
Tests for bench.py's command line on a CPU.

$ python -m pytest test_bench.py -q
"""

import pytest

import bench


def test_unknown_section_is_one_line(monkeypatch):
    """A section name bench.py does not have is refused with the list of those it has."""
    monkeypatch.setattr('sys.argv', ['bench.py', '--sections', 'saved,nosuch'])
    with pytest.raises(SystemExit, match=r'^bench.py: unknown section nosuch; choose from .*\bstep\b'):
        bench.main()


def test_gpu_sections_need_a_gpu(monkeypatch):
    """Without CUDA, only the CPU sections run; the others say so in one line."""
    monkeypatch.setattr('sys.argv', ['bench.py', '--sections', 'kernels'])
    monkeypatch.setattr('torch.cuda.is_available', lambda: False)
    with pytest.raises(SystemExit, match='bench.py needs a CUDA device'):
        bench.main()
