"""pytest: every test starts from the FP32 matmul precision the session started with. train.main
turns TF32 on for the whole process, as a training run should; a test or fixture that calls it
in-process must not change the FP32 numerics of the tests after it (on a GPU, a TF32 GEMM differs
from an exact one by ~1e-3). The flags are set before each test, not only restored after it: a
module-scoped fixture that trains runs before the first test's function-scoped fixtures (so
a GPU test once ran its FP32 comparison in TF32 that way)."""
import os

import pytest
import torch
from hypothesis import settings

# Hypothesis in CI: the same examples on every run (derandomize), no per-example deadline (a
# shared 2-core runner times tensors unevenly), and a failure prints the blob that replays it
# (@reproduce_failure). HYPOTHESIS_PROFILE=fuzz draws fresh examples instead, for a deeper local
# search; FP4_FUZZ_SCALE multiplies every numerics test's example count (test_formats.fuzz).
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
settings.register_profile("fuzz", deadline=None, derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Under xdist (pytest.ini: -n 2 on CI's 2 cores) one OpenMP thread a worker, and for the train.py
# and torchrun processes the tests start: with two threads each, more threads than cores wait in
# OpenMP's barriers (a tiny run's step 7x slower in test_fsdp; the suite, on 2 cores shared with
# other jobs, 800 tests in 47 min against 10 min with one thread).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

SESSION_FLAGS = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)


@pytest.fixture(autouse=True)
def _session_tf32():
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = SESSION_FLAGS
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = SESSION_FLAGS
