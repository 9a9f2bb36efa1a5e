"""pytest: every test starts from the FP32 matmul precision the session started with. train.main
turns TF32 on for the whole process, as a training run should; a test or fixture that calls it
in-process must not change the FP32 numerics of the tests after it (on a GPU, a TF32 GEMM differs
from an exact one by ~1e-3). The flags are set before each test, not only restored after it: a
module-scoped fixture that trains runs before the first test's function-scoped fixtures (so
a GPU test once ran its FP32 comparison in TF32 that way)."""
import pytest
import torch

SESSION_FLAGS = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)


@pytest.fixture(autouse=True)
def _session_tf32():
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = SESSION_FLAGS
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = SESSION_FLAGS
