"""
lora.py: the low-rank half of Full-Stack FP4's LoRA-SVD projections (SPEC 8.4), the parts that
need no FP4: the randomized SVD that fits L, the default rank, and the schedule of refits.
fp4.py's FP4Linear holds L in BF16 buffers and quantizes R = W - L.
"""
import math

import torch


LORA_OVERSAMPLE = 16  # p: Halko et al. suggest 5-10; a refit is rare, so spend a little more
LORA_POWER_ITERS = 4  # q: subspace iterations (A A^T)^q A Omega, for slowly decaying spectra
LORA_FRACTION = 1 / 16  # default rank: this fraction of min(in, out), in multiples of 16 (docs/fullstack.md, LoRA-SVD)



def lora_rank_for(in_features, out_features):
    """The default rank: min(in, out) * LORA_FRACTION rounded up to a multiple of 16 (BF16 GEMM
    tiles), at least 16."""
    return 16 * max(1, math.ceil(min(in_features, out_features) * LORA_FRACTION / 16))


def randomized_svd(a, rank, oversample=LORA_OVERSAMPLE, power_iters=LORA_POWER_ITERS, seed=0):
    """The top-`rank` singular triplets of a (m, n): U (m, r), S (r,), V (n, r), FP32, by
    randomized subspace iteration and a small exact SVD (Halko, Martinsson, Tropp 2011, SIAM
    Review 53(2), Algorithms 4.4 and 5.1). a ~= U diag(S) V^T."""
    if a.ndim != 2:
        raise ValueError(f"randomized_svd takes a 2-D tensor, got shape {tuple(a.shape)}")
    if not 0 < rank <= min(a.shape):
        raise ValueError(f"rank must be in 1..min{tuple(a.shape)} = {min(a.shape)}, got {rank}")
    if oversample < 0 or power_iters < 0:
        raise ValueError(f"oversample and power_iters must be >= 0, got {oversample} and {power_iters}")
    a = a.detach().float()
    q = _range_finder(a, min(rank + oversample, min(a.shape)), power_iters, seed)  # (m, l)
    ub, s, vh = torch.linalg.svd(q.t() @ a, full_matrices=False)  # B = Q^T A (l, n) = Ub S Vh
    return q @ ub[:, :rank], s[:rank], vh[:rank].t()


def _range_finder(a, l, power_iters, seed):
    """Q (m, l) with orthonormal columns, range(Q) ~ the top-l left singular space of a: QR of
    A Omega (Omega (n, l) Gaussian, drawn on the CPU from seed: the same on every device), then
    power_iters rounds of A^T, A with a QR after each product (Halko Alg. 4.4: without the
    re-orthonormalization FP32 loses every direction below sigma_1 * eps^(1/(2q+1)))."""
    omega = torch.randn(a.shape[1], l, generator=torch.Generator().manual_seed(seed))
    q = torch.linalg.qr(a @ omega.to(a.device)).Q
    for _ in range(power_iters):
        q = torch.linalg.qr(a.t() @ q).Q  # (n, l)
        q = torch.linalg.qr(a @ q).Q  # (m, l)
    return q


def lora_refit_due(step, interval, first):
    """Whether fullstack refits L (SPEC.md 8.4) before this step: at 0 and every `interval` steps
    (the paper's schedule), and below the first interval also at first, 2 first, 4 first, ...
    The fit at step 0 is of the random init, whose top directions the trained W does not keep
    (docs/fullstack.md, "How stale L gets": it cuts the FP4 error by 1.1%, a refit by 56.9%), and W's top
    directions form early and then hold (an L fitted 80 steps before keeps 82% of a refit's
    cut): so refits come often at first and then spread out. interval <= 0: never (L stays 0)."""
    if interval <= 0:
        return False
    if step % interval == 0:
        return True
    if first <= 0 or step >= interval or step < first or step % first:
        return False
    ratio = step // first
    return ratio & (ratio - 1) == 0  # a power of two


def lora_schedule_warning(max_iters, interval, first):
    """What is wrong with a fullstack run's refit schedule (lora_refit_due), or None: L never
    fitted, or fitted only at step 0, to the initial weights, whose top directions the trained W
    does not keep (docs/fullstack.md, "How stale L gets")."""
    if interval <= 0:
        return (f'lora_refit_interval {interval}: L is never fitted, so it stays 0 '
                '(the low-rank part does nothing; --lora_rank=-1 says so)')
    first_refit = min(first, interval) if first > 0 else interval
    if 1 < max_iters <= first_refit:
        every = max(1, max_iters // 8)
        return (f'L (LoRA-SVD) is fitted at step 0, to the initial weights, and never refit: max_iters '
                f'{max_iters}, lora_refit_interval {interval}, lora_refit_first {first}. '
                f'The trained W soon has other top directions (docs/fullstack.md: "How stale L gets"); '
                f'--lora_refit_interval={every} refits it every {every} steps ({(max_iters - 1) // every} refits)')
    return None
