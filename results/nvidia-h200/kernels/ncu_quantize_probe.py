"""The launches profiled in ncu_quantize.txt: the forward quantize (MXFP4, QuEST, Hadamard-32) and
the backward re-quantize (RHT-32, SR) of a 16384x8192 BF16 tensor, each launched twice (the
first launch compiles). Run from the repository root under ncu (see ncu_quantize.txt)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import torch  # noqa: E402

import fp4  # noqa: E402

torch.manual_seed(0)
x = torch.randn(16384, 8192, device="cuda", dtype=torch.bfloat16)
signs = fp4.random_signs(32, 3)
for _ in range(2):
    q = fp4.quantize(x, "mxfp4", scale_rule="quest", hadamard=32)
for _ in range(2):
    r = fp4.requantize(q, rounding="sr", hadamard=32, signs=signs)
torch.cuda.synchronize()
