"""
The scaling law of the accuracy study, in Quartet's form (SPEC.md 6):
    L(N, D) = (A / (N effN)^a + B / (D effD)^b)^g + E,
N non-embedding parameters, D training tokens, effN and effD a recipe's effective-parameter and
effective-data factors (1 for the reference, bf16). Fitted by least squares (Levenberg-Marquardt)
on cell means, with standard errors from the Jacobian, a bootstrap over seeds for the factors,
and a check that the fit describes the runs at all (law_problems).

analysis.py reads the runs and calls fit_auto and bootstrap_eff; nothing here reads files.
"""

import math

import numpy as np

REFERENCE = 'bf16'  # the recipe every factor is relative to (its effN = effD = 1)
# Quartet's BF16 fit (SPEC.md 6) and its effective-parameter / effective-data factors for
# MXFP4 (Quartet, arXiv 2505.14669)
QUARTET_LAW = dict(A=127444.7, a=0.5785, B=465834.3, b=0.5389, E=1.3408, g=0.2764)
QUARTET_EFF = {'quartet': (0.658, 0.822)}
LOG_EFF_BOUND = math.log(1e3)  # fitted effN, effD lie in [1e-3, 1e3] (law.bounded)


def law_loss(N, D, p, eff_n=1.0, eff_d=1.0):
    """L = (A / (N effN)^a + B / (D effD)^b)^g + E; N non-embedding parameters, D tokens."""
    return (p['A'] / (N * eff_n) ** p['a'] + p['B'] / (D * eff_d) ** p['b']) ** p['g'] + p['E']

def _jacobian(residual, theta):
    cols = []
    for i in range(len(theta)):
        h = 1e-6 * max(1.0, abs(theta[i]))
        up, down = theta.copy(), theta.copy()
        up[i] += h
        down[i] -= h
        cols.append((residual(up) - residual(down)) / (2 * h))
    return np.stack(cols, axis=1)

def _finite_or_inf(residual):
    """residual, with a step whose parameters overflow (exp of a huge log-factor, a negative base
    to a fractional power) scored as infinitely bad instead of raising: the search steps back."""
    def safe(theta):
        try:
            with np.errstate(all='ignore'):
                r = np.asarray(residual(theta), dtype=np.float64)
        except (OverflowError, ValueError, ZeroDivisionError):
            return np.full(1, np.inf)
        return r if np.all(np.isfinite(r)) else np.full(r.shape, np.inf)
    return safe

def levenberg_marquardt(residual, theta, iters=500):
    """Minimise |residual(theta)|^2 from theta. Returns (theta, Jacobian, residuals)."""
    residual = _finite_or_inf(residual)
    theta = np.asarray(theta, dtype=np.float64)
    r = residual(theta)
    if not np.all(np.isfinite(r)):
        raise ValueError(f'the law fit\'s start {theta} gives a non-finite loss')
    cost, lam = r @ r, 1e-3
    for _ in range(iters):
        J = _jacobian(residual, theta)
        JtJ, grad = J.T @ J, J.T @ r
        while lam < 1e12:  # raise the damping until a step lowers the cost
            step = np.linalg.lstsq(JtJ + lam * np.diag(np.diag(JtJ) + 1e-12), -grad, rcond=None)[0]
            r_new = residual(theta + step)
            if np.all(np.isfinite(r_new)) and r_new @ r_new < cost:
                break
            lam *= 4
        else:
            break  # no step helps: a minimum, to the precision of the Jacobian
        gain = (cost - r_new @ r_new) / max(cost, 1e-300)
        theta, r, cost, lam = theta + step, r_new, r_new @ r_new, max(lam / 3, 1e-12)
        if gain < 1e-15 or cost < 1e-30:
            break
    return theta, _jacobian(residual, theta), r

def _start(N, D, L, n_groups, exps=None):
    """A, B, E to start from, for exponents exps (a, b, g; default Quartet's): for each E on a
    grid below the smallest loss, (L - E)^(1/g) = A N^-a + B D^-b is linear in A and B."""
    q = dict(zip('abg', exps)) if exps else QUARTET_LAW
    X = np.stack([N ** -q['a'], D ** -q['b']], axis=1)
    best = None
    for E in np.linspace(0.0, L.min() - 1e-3, 60):
        u = (L - E) ** (1 / q['g'])
        AB = np.maximum(np.linalg.lstsq(X, u, rcond=None)[0], 1e-6 * u.mean() / X.mean(axis=0))
        sse = np.sum(((X @ AB) ** q['g'] + E - L) ** 2)
        if best is None or sse < best[0]:
            best = (sse, np.log(AB[0]), np.log(AB[1]), E)
    return np.array([best[1], best[2], best[3]] + [0.0] * (2 * n_groups))

def fit_law(cells, ref=REFERENCE, exponents='quartet', start=None):
    """Fit cells [(group, N, D, loss)]: A, B, E shared by every group (and a, b, g when
    exponents='free'; else Quartet's BF16 exponents), effN and effD per group, the reference
    group's fixed at 1. Standard errors from the Jacobian: s^2 (J^T J)^-1, s^2 = SSE / dof."""
    if exponents not in ('quartet', 'free'):
        raise ValueError(f"exponents must be 'quartet' or 'free', got {exponents!r}")
    groups = sorted({c[0] for c in cells} - {ref})
    N, D, L = (np.array([c[i] for c in cells], dtype=np.float64) for i in (1, 2, 3))
    row = np.array([groups.index(c[0]) + 1 if c[0] != ref else 0 for c in cells])
    if not (row == 0).any():
        raise ValueError(f'the law fit needs runs of the reference recipe {ref!r}')
    k = 6 if exponents == 'free' else 3  # shared parameters before the per-group ones

    def unpack(theta):
        p = dict(A=math.exp(theta[0]), B=math.exp(theta[1]), E=theta[2])
        if k == 6:
            p.update(a=math.exp(theta[3]), b=math.exp(theta[4]), g=math.exp(theta[5]))
        else:
            p.update(a=QUARTET_LAW['a'], b=QUARTET_LAW['b'], g=QUARTET_LAW['g'])
        log_eff = np.concatenate([[0.0, 0.0], bounded(theta[k:])]).reshape(-1, 2)  # row 0: the reference
        return p, np.exp(log_eff[row])                                               # (cells, 2)

    def residual(theta):
        p, eff = unpack(theta)
        return law_loss(N, D, p, eff[:, 0], eff[:, 1]) - L

    if start is None:
        start = _start(N[row == 0], D[row == 0], L[row == 0], len(groups))
        if k == 6:
            q = QUARTET_LAW
            start = np.concatenate([start[:3], np.log([q['a'], q['b'], q['g']]), start[3:]])
    theta, J, r = levenberg_marquardt(residual, start)
    dof = len(L) - len(theta)
    se = np.full(len(theta), math.nan)
    if dof > 0:
        with np.errstate(invalid='ignore'):  # a negative diagonal (a flat direction): no SE, NaN
            se = np.sqrt(np.diag(r @ r / dof * np.linalg.pinv(J.T @ J)))
    p, _ = unpack(theta)
    # effN = exp(theta): its standard error is effN * se(theta) (delta method)
    log_eff = bounded(theta[k:])
    eff = {g: (math.exp(log_eff[2 * i]), math.exp(log_eff[2 * i + 1])) for i, g in enumerate(groups)}
    at_bound = sorted(g for i, g in enumerate(groups) if np.any(np.abs(log_eff[2 * i:2 * i + 2]) >= LOG_EFF_BOUND))
    eff_se = {g: (eff[g][0] * se[k + 2 * i], eff[g][1] * se[k + 2 * i + 1]) for i, g in enumerate(groups)}
    exp_se = {n: p[n] * se[j] for j, n in ((3, 'a'), (4, 'b'), (5, 'g'))} if k == 6 else {}
    ref_n, ref_d = N[row == 0], D[row == 0]
    return dict(params=p, eff=eff, eff_se=eff_se, exponent_se=exp_se, exponents=exponents,
                rms=float(np.sqrt(np.mean(r ** 2))), n=len(L), dof=dof, theta=theta,
                problems=law_problems(p, ref_n, ref_d, at_bound))

def bounded(log_eff):
    """log effN, log effD within +-LOG_EFF_BOUND: where the data leave a factor free, the fit
    would push it without end (its term to 0) and overflow; at the bound it is flagged instead."""
    return np.clip(np.asarray(log_eff, dtype=np.float64), -LOG_EFF_BOUND, LOG_EFF_BOUND)

def law_problems(p, N, D, at_bound=()):
    """Why fitted parameters p do not describe the reference cells (N, D), [] when nothing is
    wrong: E < 0 (cross-entropy cannot fall below zero); a term, A / N^a or B / D^b, below 0.1% of
    the other at every cell (the loss then depends on N or on D alone: the fit dropped a dimension
    of the law rather than fitted it); an effN or effD at its bound (the data do not pin it)."""
    out = []
    if p['E'] < 0:
        out.append(f"E = {p['E']:.3f} < 0, a loss below zero")
    with np.errstate(over='ignore'):  # a runaway exponent: N^a = inf, its term 0, flagged below
        t_n, t_d = p['A'] / N ** p['a'], p['B'] / D ** p['b']
    for name, mine, other, alone in (('A / N^a', t_n, t_d, 'D'), ('B / D^b', t_d, t_n, 'N')):
        if np.all(mine < 1e-3 * other):
            out.append(f'the term {name} is below 0.1% of the other at every cell (a loss of {alone} alone)')
    if at_bound:
        out.append(f"effN or effD of {', '.join(at_bound)} at the fit's bound ({math.exp(LOG_EFF_BOUND):g} "
                   f"or 1/{math.exp(LOG_EFF_BOUND):g}): not pinned by the data")
    return out

def fit_auto(cells, ref=REFERENCE, max_rel_se=0.3):
    """Free exponents where the data pins them (>= 3 sizes and >= 3 budgets of the reference,
    each exponent's standard error under max_rel_se of it), else Quartet's. Says which."""
    fixed = fit_law(cells, ref, 'quartet')
    ref_cells = [c for c in cells if c[0] == ref]
    sizes, budgets = len({c[1] for c in ref_cells}), len({c[2] for c in ref_cells})
    why = f'{sizes} sizes x {budgets} token budgets of {ref}'
    if sizes >= 3 and budgets >= 3:
        free = fit_free(cells, ref, fixed['theta'])
        rel = [free['exponent_se'][n] / free['params'][n] for n in 'abg']
        if all(np.isfinite(rel)) and max(rel) < max_rel_se:
            free['note'] = f'exponents a, b, g fitted ({why})'
            return free
        why += (f'; fitted exponents had relative standard errors up to {max(rel):.2f}' if all(np.isfinite(rel))
                else '; the fitted exponents had no finite standard errors')
        q, se = free['params'], free['exponent_se']
        why += ('; that fit: ' + ', '.join(f'{n} = {q[n]:.3g} ± {se[n]:.2g}' for n in 'abg')
                + f", E = {q['E']:.3g}, rms {free['rms']:.3g} nats")
    fixed['note'] = (f"exponents fixed to Quartet's BF16 fit (a={QUARTET_LAW['a']}, "
                     f"b={QUARTET_LAW['b']}, g={QUARTET_LAW['g']}): the data ({why}) cannot pin them")
    return fixed

FREE_STARTS = [(QUARTET_LAW['a'], QUARTET_LAW['b'], QUARTET_LAW['g']), (0.34, 0.28, 1.0),  # Chinchilla's
               (0.3, 0.3, 0.5), (0.5, 0.5, 1.0), (0.3, 0.8, 1.0), (0.8, 0.3, 1.0)]

def fit_free(cells, ref, fixed_theta):
    """The free-exponent fit from several starts: the fixed fit's A, B, E and factors with Quartet's
    exponents, and each of FREE_STARTS' exponents with A, B, E solved for them and every factor 1
    (a start where one term is zero cannot find it again: its gradient vanishes). The best by rms
    among the fits law_problems finds nothing wrong with, else the best."""
    N, D, L = (np.array([c[i] for c in cells if c[0] == ref], dtype=np.float64) for i in (1, 2, 3))
    starts = [np.concatenate([fixed_theta[:3], np.log(FREE_STARTS[0]), fixed_theta[3:]])]
    for exps in FREE_STARTS:  # effN = effD = 1 to start: the fixed fit's may sit at their bounds
        s0 = _start(N, D, L, 0, exps)
        starts.append(np.concatenate([s0[:3], np.log(exps), np.zeros(len(fixed_theta) - 3)]))
    fits = []
    for start in starts:
        try:
            fits.append(fit_law(cells, ref, 'free', start=start))
        except (ValueError, np.linalg.LinAlgError):  # a start the law cannot be evaluated at
            continue
    good = [f for f in fits if not f['problems']]
    return min(good or fits, key=lambda f: f['rms'])

def pooled_seed_sd(seed_losses):
    """The relative sd of a run's loss about its cell's mean, pooled over the cells with >= 2 seeds
    (n - 1 degrees of freedom each): the seed noise that a cell of one seed carries unseen.
    seed_losses: {(group, N, D): {seed: loss}}. Returns (sd, cells pooled); sd is None without any."""
    ss, dof, cells = 0.0, 0, 0
    for v in seed_losses.values():
        if len(v) > 1:
            x = np.array(list(v.values()), dtype=np.float64)
            ss, dof, cells = ss + np.sum((x / x.mean() - 1) ** 2), dof + len(x) - 1, cells + 1
    return (math.sqrt(ss / dof) if dof else None), cells

def bootstrap_eff(seed_losses, ref, exponents, start, n_boot=200, rng_seed=0, level=0.95, noise_rel=0.0):
    """Percentile intervals of effN, effD: refit on cell means of seeds drawn with replacement.
    One draw of seed ids serves every cell, so the pairing of recipes by seed is kept. A cell of one
    seed would be the same in every draw; with noise_rel its loss is drawn as L (1 + noise_rel z),
    z standard normal, each draw (the seed noise it carries unseen: pooled_seed_sd).
    seed_losses: {(group, N, D): {seed: loss}}. Returns {group: ((lo, hi) effN, (lo, hi) effD)}."""
    seeds = sorted({s for v in seed_losses.values() for s in v})
    if len(seeds) < 2 and not noise_rel:
        return {}
    rng = np.random.default_rng(rng_seed)
    draws = {}
    for _ in range(n_boot):
        pick = rng.choice(seeds, size=len(seeds))
        noise = rng.normal(0.0, 1.0, size=len(seed_losses)) * noise_rel
        cells = [(g, N, D, float(next(iter(v.values()))) * (1 + z) if len(v) == 1 else
                  float(np.mean([v[s] for s in pick if s in v] or list(v.values()))))
                 for ((g, N, D), v), z in zip(seed_losses.items(), noise)]
        for g, e in fit_law(cells, ref, exponents, start=start)['eff'].items():
            draws.setdefault(g, []).append(e)
    q = [50 * (1 - level), 100 - 50 * (1 - level)]
    return {g: tuple(tuple(np.percentile(np.array(v)[:, j], q)) for j in (0, 1)) for g, v in draws.items()}
