"""pytest: every test starts from the same FP32 matmul precision. train.main turns TF32 on for the
whole process, as a training run should; a test that calls it in-process must not change the FP32
numerics of the tests after it (on a GPU, a TF32 reference GEMM differs from an exact one by ~1e-3)."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _restore_tf32():
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
