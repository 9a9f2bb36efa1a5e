"""
The accuracy study's analysis: what study.py's runs say. From the run JSONs in
results/<gpu>/study/: the gaps to BF16 paired by seed with Student-t intervals, the gaps along
the loss curves, the Quartet-form scaling law (SPEC.md 6; fitted in law.py) with effN and effD
per recipe and bootstrap intervals, and the report (report.md, report.json, curves_*.png, law.png).

$ python study/study.py report                 # the same as analysis.report(results/<gpu>/study)

study.py runs the grid and records each run; nothing here trains or needs a GPU.
"""

import math
import os
import statistics

import numpy as np

from law import QUARTET_EFF, QUARTET_LAW, REFERENCE, bootstrap_eff, fit_auto, fit_law, law_loss, pooled_seed_sd
from model import RECIPES, SIZES, fp4_blocks
from records import LAUNCH_ONLY, load_records, reruns_of, tokens_label, write_json

# every gap is against REFERENCE, bf16 (under the same optimizer, see reference_of); the published
# gaps a user compares with
PUBLISHED = ('Quartet: +2.6% to +2.9% val loss over BF16 at 100 tokens/param (200M-800M, C4); '
             'Full-Stack FP4: +0.84% to +1.47% (3B, 64B tokens)')

# -----------------------------------------------------------------------------
# statistics: Student-t intervals on paired differences

def t_two_sided(t, df):
    """P(|T| <= t) for Student's t with integer df (Abramowitz & Stegun 26.7.3-26.7.4)."""
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2 == 0:
        term = total = 1.0
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        return s * total
    term = total = math.cos(theta)
    for k in range(1, (df - 1) // 2):
        term *= c2 * (2 * k) / (2 * k + 1)
        total += term
    return 2 / math.pi * (theta + (s * total if df > 1 else 0.0))

def t_quantile(p, df):
    """The p-quantile (p > 0.5) of Student's t with df degrees of freedom, by bisection."""
    if not 0.5 < p < 1 or df < 1:
        raise ValueError(f'need 0.5 < p < 1 and df >= 1, got p={p}, df={df}')
    lo, hi = 0.0, 1.0
    while t_two_sided(hi, df) < 2 * p - 1:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_two_sided(mid, df) < 2 * p - 1 else (lo, mid)
    return (lo + hi) / 2

def paired_gap(ref, other, level=0.95):
    """ref, other: {seed: val loss}. The relative gap other/ref - 1 per shared seed, its mean
    and the t-interval mean +- t(1 - (1-level)/2, n-1) sd / sqrt(n); the same in nats.
    Pairing removes what the seed does to both runs (init, data order, eval batches)."""
    seeds = sorted(set(ref) & set(other))
    rel = [other[s] / ref[s] - 1 for s in seeds]
    nats = [other[s] - ref[s] for s in seeds]
    out = dict(n=len(seeds), seeds=seeds)
    for name, xs in (('rel', rel), ('nats', nats)):
        mean = statistics.fmean(xs) if xs else math.nan
        half = math.nan
        if len(xs) >= 2:
            half = t_quantile(1 - (1 - level) / 2, len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
        out.update({name: mean, f'{name}_lo': mean - half, f'{name}_hi': mean + half})
    return out

# -----------------------------------------------------------------------------
# report: tables, curves, the law

def by_cell(records):
    """{(size, tokens): {group: {seed: record}}} of every run, cells ordered by N then D."""
    cells = {}
    for rec in records.values():
        cells.setdefault((rec['model_size'], rec['tokens']), {}).setdefault(rec['group'], {})[rec['seed']] = rec
    order = sorted(cells, key=lambda c: (min(r['n_params'] for g in cells[c].values() for r in g.values()), c[1]))
    return {c: cells[c] for c in order}

def group_order(groups):
    rank = {r: i for i, r in enumerate(RECIPES)}
    return sorted(groups, key=lambda g: ('+' in g, rank.get(g.split('+')[0], 99), g))

def flags_of(group, groups):
    """The train.py flags a group's runs were given (study.py's -- flags: its variant), less those
    that change only how fast the same numbers come (records.LAUNCH_ONLY: --compile_mode)."""
    flags = next(iter(groups[group].values())).get('flags') or ()
    return tuple(f for f in flags if f.lstrip('-').partition('=')[0] not in LAUNCH_ONLY)

def commits_of(group, groups):
    return {r.get('git_commit') for r in groups[group].values()}

def optimizer_of(group, groups):
    """The --optimizer a group's runs were given in their variant's flags ('' for the default)."""
    return next((f.partition('=')[2] for f in flags_of(group, groups) if f.startswith('--optimizer=')), '')

def own_reference(group, groups):
    """What a variant is compared with inside its recipe: the recipe's group whose flags are the
    largest proper subset of its own, which differs from it by the fewest flags (nvfp4+root_ends_fp4,
    --optimizer=root --end_blocks=fp4, against nvfp4+root: what --end_blocks changes, not what ROOT
    does; of two such, the one at the same FP4 coverage), the plain recipe among them; else its `+full` variant (an ablation, whose flags take a
    part out: what leaving it out costs; `+full` itself only against the plain recipe). None for a
    plain recipe, or where the cell has neither."""
    base, _, variant = group.partition('+')
    if not variant:
        return None
    mine = set(flags_of(group, groups))
    blocks = low_precision_blocks(next(iter(groups[group].values())))
    kin = [(len(set(flags_of(g, groups))), low_precision_blocks(next(iter(groups[g].values()))) == blocks,
            bool(commits_of(g, groups) & commits_of(group, groups)), g)
           for g in groups  # the whole is its ablations' reference, not theirs; ties: the same FP4
           if g != group and g.partition('+')[0] == base  # coverage first, then the same code
           and set(flags_of(g, groups)) < mine and variant != WHOLE]
    if kin:
        return max(kin)[-1]
    if base in groups:
        return base
    whole = f'{base}+{WHOLE}'
    return whole if whole in groups and whole != group else None

def reference_of(group, groups):
    """The runs a group's gap is taken against: bf16 under the same variant if the cell has
    it (e.g. bf16+root for quartet+root); else, for an FP4 recipe whose variant changes the
    optimizer, bf16 under that optimizer without FP4 (fullstack+full, which trains with
    root_fp4, against bf16+root: ROOT alone lowers the loss by ~11% here, which is not FP4's doing);
    else plain bf16."""
    base, _, variant = group.partition('+')
    same = f'{REFERENCE}+{variant}' if variant else REFERENCE
    if same in groups and same != group:
        return same
    opt = optimizer_of(group, groups).partition('_fp4')[0]
    twin = f'{REFERENCE}+{opt}'
    if base != REFERENCE and opt not in ('', 'adamw') and twin in groups:
        return twin
    return REFERENCE

def loss_key(groups):
    """The loss a cell compares: 'val_loss_split' (the same val text for every run) where every
    finished run of the cell has it, else 'val_loss' (eval batches drawn by each run's seed; the
    runs of one seed share them, so paired gaps stay paired, but across seeds they add spread)."""
    ok = [r for runs in groups.values() for r in runs.values() if r['status'] == 'ok']
    return 'val_loss_split' if ok and all(r.get('val_loss_split') is not None for r in ok) else 'val_loss'

def val_losses(runs, key='val_loss'):
    return {s: r[key] for s, r in runs.items() if r['status'] == 'ok'}

def gap_rows(records):
    """One row per (cell, group): losses over seeds, the paired gap to its reference."""
    rows = []
    for (size, tokens), groups in by_cell(records).items():
        key = loss_key(groups)
        for group in group_order(groups):
            runs = groups[group]
            ok = [r for r in runs.values() if r['status'] == 'ok']
            losses = val_losses(runs, key)
            any_run = next(iter(runs.values()))
            ref = reference_of(group, groups)
            row = dict(size=size, tokens=tokens, group=group, ref=ref, seeds=sorted(losses), n_params=any_run['n_params'],
                       fp4_blocks=low_precision_blocks(any_run),
                       diverged=sorted(s for s, r in runs.items() if r['status'] == 'diverged'),
                       tokens_per_param=tokens / any_run['n_params'], epochs=any_run['epochs'],
                       mean=statistics.fmean(losses.values()) if losses else math.nan,
                       sd=statistics.stdev(losses.values()) if len(losses) > 1 else math.nan,
                       eval='split' if key == 'val_loss_split' else 'batches',
                       eval_se=statistics.median(r['val_loss_se'] for r in ok) if ok else math.nan,
                       tokens_per_s=statistics.median(r['tokens_per_s'] for r in ok) if ok else math.nan,
                       commits=sorted({r['git_commit'] or '?' for r in runs.values()}),
                       corpora=sorted({r['corpus']['train_sha1'] for r in runs.values()}))
            if group != ref and ref in groups:
                row['gap'] = paired_gap(val_losses(groups[ref], key), losses)
            base, _, variant = group.partition('+')
            own = own_reference(group, groups)
            if own:
                row['base'], row['vs_base'] = own, paired_gap(val_losses(groups[own], key), losses)
            twin = f"{base}+{variant.partition('_fp4')[0]}"  # root_fp4's (root_fp4x2's) twin is root: not in FP4
            if '_fp4' in variant and twin in groups:
                row['twin'], row['vs_twin'] = twin, paired_gap(val_losses(groups[twin], key), losses)
            rows.append(row)
    return rows

def low_precision_blocks(run):
    """'k/L': how many of the model's L blocks ran their linears in FP4 (FP8 under float8), by
    model.fp4_blocks: nvfp4 keeps the first and last in BF16 unless --end_blocks says otherwise,
    so recipes compared at one size may differ in coverage, which the table shows."""
    cfg = run.get('train_config') or {}
    if run.get('model_size') not in SIZES or run.get('recipe') not in RECIPES:  # an older code's record
        return '?'
    n_layer = SIZES[run['model_size']]['n_layer']
    return f"{len(fp4_blocks(n_layer, run['recipe'], cfg.get('end_blocks', 'auto')))}/{n_layer}"

WHOLE = 'full'  # the variant naming a recipe with all its parts (fullstack+full); its ablations compare with it


def curve_gaps(records):
    """Each FP4 recipe's paired gap to its bf16 reference (reference_of) at every eval of the curve
    both runs of a seed have, after step 0: dicts of size, tokens, group, ref, step, the reference's
    mean loss there and the per-seed gaps. The evals' batches are drawn by the seed, so the pair
    of a seed shares them. Whether a gap follows the loss reached or the optimizer and schedule:
    compare the gaps at equal reference loss."""
    out = []
    for (size, tokens), groups in by_cell(records).items():
        for group in group_order(groups):
            ref = reference_of(group, groups)
            if group.partition('+')[0] == REFERENCE or ref not in groups:
                continue
            pairs = [(groups[ref][s]['curve'], r['curve']) for s, r in sorted(groups[group].items())
                     if r['status'] == 'ok' and groups[ref].get(s, {}).get('status') == 'ok']
            if not pairs:
                continue
            steps = set.intersection(*(set(b['val_steps']) & set(q['val_steps']) for b, q in pairs)) - {0}
            for step in sorted(steps):
                at = [(b['val_loss'][b['val_steps'].index(step)], q['val_loss'][q['val_steps'].index(step)])
                      for b, q in pairs]
                out.append(dict(size=size, tokens=tokens, group=group, ref=ref, step=step,
                                ref_loss=statistics.fmean(lb for lb, _ in at), gaps=[lq / lb - 1 for lb, lq in at]))
    return out

def md_table(intro, columns, rows):
    """A paragraph and a markdown table under it ('' without rows); rows: lists of cell strings."""
    if not rows:
        return ''
    lines = [intro, '', '| ' + ' | '.join(columns) + ' |', '|' + '---|' * len(columns)]
    return '\n'.join(lines + ['| ' + ' | '.join(map(str, r)) + ' |' for r in rows]) + '\n'

def curve_gap_table(records):
    return md_table('Each FP4 recipe\'s gap along the curve (the evals\' per-seed batches, paired by seed): compare '
                    'the gaps at equal reference loss to tell the loss reached from the optimizer and schedule.',
                    ['size', 'tokens', 'recipe', 'against', 'step', 'reference val loss', 'gap per seed'],
                    [[g['size'], tokens_label(g['tokens']), g['group'], g['ref'], g['step'], f"{g['ref_loss']:.3f}",
                      ', '.join(f'{100 * x:+.2f}%' for x in g['gaps'])] for g in curve_gaps(records)])

def rerun_table(directory, records):
    """The reruns study.merge kept in <directory>_repeats/ against the recorded runs of their
    ids: how far running the same config and seed again moves the loss (the GPU's sums are not
    bit-reproducible), a floor under any difference the study can resolve."""
    rows, changes = [], []
    for run_id, rec in sorted(records.items()):
        for rerun in reruns_of(directory.rstrip(os.sep) + '_repeats', run_id):
            key = 'val_loss_split' if rec.get('val_loss_split') and rerun.get('val_loss_split') else 'val_loss'
            a, b = rec.get(key), rerun.get(key)
            if a and b:
                changes.append(b / a - 1)
                rows.append([run_id, f'{a:.4f}', f'{b:.4f}', f'{100 * changes[-1]:+.2f}%',
                             'whole split' if key == 'val_loss_split' else 'per-seed batches'])
    if not rows:
        return ''
    return md_table(f'Reruns: a run id (its config and seed) run again (study.py merge keeps them in '
                    f'{os.path.basename(directory.rstrip(os.sep))}_repeats/); |change| median '
                    f'{100 * statistics.median(abs(c) for c in changes):.2f}%, largest '
                    f'{100 * max(abs(c) for c in changes):.2f}%, over {len(changes)} pairs. Seed pairing '
                    'cannot cancel this part of the noise.',
                    ['run', 'recorded', 'rerun', 'change', 'eval'], rows)

ABLATION = 'no_'  # an ablation's variant names the part it leaves out (fullstack+no_lora)


def equal_coverage_pairs(records):
    """FP4 recipes against each other, paired by seed, where the comparison is like for like: the
    same cell, the same optimizer family (root_fp4 is ROOT's) and bf16 reference, and the same
    FP4 coverage (low_precision_blocks), different recipes, ablations left out. Dicts of size,
    tokens, group, against, blocks and gap (group's loss / against's - 1 per shared seed)."""
    out = []
    for (size, tokens), groups in by_cell(records).items():
        key = loss_key(groups)
        fp4 = [g for g in group_order(groups) if g.partition('+')[0] != REFERENCE
               and not g.partition('+')[2].startswith(ABLATION)]
        blocks = {g: low_precision_blocks(next(iter(groups[g].values()))) for g in fp4}
        family = {g: optimizer_of(g, groups).partition('_fp4')[0] or 'adamw' for g in fp4}  # root_fp4: root
        for i, a in enumerate(fp4):
            for b in fp4[i + 1:]:
                if (a.partition('+')[0] == b.partition('+')[0] or blocks[a] != blocks[b] or family[a] != family[b]
                        or reference_of(a, groups) != reference_of(b, groups)):
                    continue
                gap = paired_gap(val_losses(groups[a], key), val_losses(groups[b], key))
                if gap['n'] >= 2:
                    out.append(dict(size=size, tokens=tokens, group=b, against=a, blocks=blocks[a],
                                    ref=reference_of(a, groups), gap=gap))
    return out

def equal_coverage_table(records):
    return md_table('FP4 recipes against each other at equal FP4 coverage, under the same optimizer (the same bf16 '
                    'reference), paired by seed: the gap is L(recipe) / L(against) - 1; negative: the recipe is closer '
                    'to bf16.', ['size', 'tokens', 'FP4 blocks', 'recipe', 'against', 'gap', '95% interval', 'both against'],
                    [[p['size'], tokens_label(p['tokens']), p['blocks'], p['group'], p['against'], *fmt_gap(p['gap']),
                      p['ref']] for p in equal_coverage_pairs(records)])

def fmt_gap(gap):
    if gap is None or gap['n'] == 0:
        return '—', '—'
    if gap['n'] < 2:
        return f"{100 * gap['rel']:+.2f}%", 'one seed: none'
    return f"{100 * gap['rel']:+.2f}%", f"[{100 * gap['rel_lo']:+.2f}%, {100 * gap['rel_hi']:+.2f}%]"

def gap_cells(gap, against, row, rows):
    """(gap, interval) as fmt_gap, the gap followed by ' (sd X%: within|outside)': the seed sd of
    `against`'s runs in row's cell, relative to their mean, and whether the mean gap is inside it
    (the issues' "within the seed spread"); no sd without 2 seeds."""
    text, interval = fmt_gap(gap)
    ref = next((r for r in rows if (r['size'], r['tokens'], r['group']) == (row['size'], row['tokens'], against)), None)
    if gap and gap['n'] >= 2 and ref is not None and np.isfinite(ref['sd']):
        sd = ref['sd'] / ref['mean']
        text += f" (sd {100 * sd:.2f}%: {'within' if abs(gap['rel']) <= sd else 'outside'})"
    return text, interval

def fmt_eval(row):
    return 'whole split' if row['eval'] == 'split' else f"per-seed batches, SE {row['eval_se']:.4f}"

def gap_table(rows):
    lines = ['| size | tokens | tokens/param | recipe | FP4 blocks | seeds | val loss (mean ± sd) | gap (paired) '
             '| 95% interval | eval | tokens/s |', '|' + '---|' * 11]
    for r in rows:
        gap, interval = fmt_gap(r.get('gap'))
        if r.get('gap'):
            gap += f" vs {r['ref']}" if r['ref'] != REFERENCE else ''
        sd = f" ± {r['sd']:.4f}" if np.isfinite(r['sd']) else ''
        seeds = f"{len(r['seeds'])}" + (f" (+{len(r['diverged'])} diverged)" if r['diverged'] else '')
        lines.append(f"| {r['size']} | {tokens_label(r['tokens'])} | {r['tokens_per_param']:.3g} "
                     f"| {r['group']} | {r['fp4_blocks']} | {seeds} | {r['mean']:.4f}{sd} | {gap} | {interval} "
                     f"| {fmt_eval(r)} | {r['tokens_per_s']:,.0f} |")
    return '\n'.join(lines)

def cells_named(cells):
    """'the cell 30m 50M' or 'the 3 cells 30m 3M, 50m 3M, 100m 3M'."""
    names = ', '.join(f'{size} {tokens_label(tokens)}' for size, tokens in cells)
    return f'the cell {names}' if len(cells) == 1 else f'the {len(cells)} cells {names}'

def law_section(records, exponents='auto', n_boot=200, min_tokens_per_param=0.0):
    """The fit over the val-loss means of every (group, N, D) cell; markdown and numbers.
    Cells below min_tokens_per_param are left out: early in training the loss falls with D much
    faster than the law's form allows (docs/accuracy.md, "The law")."""
    seed_losses, below = {}, []  # below: cells in by_cell's order (N, then D)
    cells_by = by_cell(records)
    # One measure for the whole fit: the split loss where any cell has it, else per-seed batches
    # everywhere (per-seed batches sit 0-1.6% off the split loss, by seed: docs/accuracy.md, "The seed spread
    # here includes the eval sample"). A run without the split loss is left out alone, and its
    # group's cell is the mean over the seeds that have it: the split is the same text for every
    # run, so those seeds differ by training alone.
    split = any(loss_key(groups) == 'val_loss_split' for groups in cells_by.values())
    other, partly = [], {}  # cells with no split loss at all; {cell: the runs left out} of the others
    for (size, tokens), groups in cells_by.items():
        n_params = next(r['n_params'] for runs in groups.values() for r in runs.values())
        if tokens / n_params < min_tokens_per_param:
            below.append((size, tokens))
            continue
        missing = []
        for group, runs in groups.items():
            losses = val_losses(runs, 'val_loss')
            if split:
                losses = {s: r['val_loss_split'] for s, r in runs.items()
                          if r['status'] == 'ok' and r.get('val_loss_split') is not None}
                missing += [(group, s) for s, r in runs.items() if r['status'] == 'ok' and s not in losses]
            if losses:
                seed_losses[(group, n_params, tokens)] = losses
        if missing and len(missing) == sum(r['status'] == 'ok' for runs in groups.values() for r in runs.values()):
            other.append((size, tokens))
        elif missing:
            partly[(size, tokens)] = missing
    left_out = (f' Left out: {cells_named(below)}, below {min_tokens_per_param:g} tokens a parameter.'
                if below else '')
    if other:
        left_out += f' Left out: {cells_named(other)}, without the whole-split loss (the fit uses that one measure).'
    for (size, tokens), missing in partly.items():
        seeds_of = {}
        for group, seed in missing:
            seeds_of.setdefault(group, []).append(str(seed))
        runs = ', '.join(f"{group} s{','.join(seeds)}" for group, seeds in seeds_of.items())
        left_out += (f' Left out of the cell {size} {tokens_label(tokens)}, without the whole-split loss: {runs}'
                     f' (its other runs are in, each group\'s mean over the seeds it has).')
    ref = [k for k in seed_losses if k[0] == REFERENCE]
    sizes, budgets = len({k[1] for k in ref}), len({k[2] for k in ref})
    if sizes < 3 or budgets < 2:
        return (f'Law fit: not yet; it needs {REFERENCE} runs at >= 3 sizes x >= 2 token budgets, '
                f'there are {sizes} x {budgets}.{left_out}'), None
    spans = {}  # group: (its sizes, its budgets)
    for g, n, d in seed_losses:
        spans.setdefault(g, (set(), set()))
        spans[g][0].add(n)
        spans[g][1].add(d)
    # effN and effD separate only where a group's runs vary both N and D: at one size, two
    # budgets give two equations that another (effN, effD) pair can meet as well, or none can
    unfit = sorted(g for g, (ns, ds) in spans.items() if g != REFERENCE and (len(ns) < 2 or len(ds) < 2))
    seed_losses = {k: v for k, v in seed_losses.items() if k[0] not in unfit}
    cells = [(g, n, d, statistics.fmean(v.values())) for (g, n, d), v in seed_losses.items()]
    fit = fit_auto(cells) if exponents == 'auto' else fit_law(cells, exponents=exponents)
    if exponents != 'auto':
        fit['note'] = f'exponents: {exponents}'
    fit['seed_losses'] = seed_losses  # the cells it took, for law.png (report() pops it: no JSON keys)
    p = fit['params']
    lines = [f"Law fit over {fit['n']} cells (mean val loss over seeds): {fit['note']}. "
             f"A = {p['A']:.4g}, a = {p['a']:.4f}, B = {p['B']:.4g}, b = {p['b']:.4f}, "
             f"g = {p['g']:.4f}, E = {p['E']:.4f}; rms residual {fit['rms']:.4f} nats.{left_out}"]
    if unfit:
        by_span = {}
        for g in group_order(unfit):
            by_span.setdefault((len(spans[g][0]), len(spans[g][1])), []).append(g)
        which = '; '.join(f"at {n} size{'s' * (n > 1)} x {d} budget{'s' * (d > 1)}: {', '.join(gs)}"
                          for (n, d), gs in sorted(by_span.items(), reverse=True))
        lines.append(f"No effN, effD (telling them apart needs a recipe's runs at >= 2 sizes and >= 2 "
                     f"token budgets) for the runs {which}.")
    if fit['problems']:
        lines.append(f"**This fit does not describe the runs**: {'; '.join(fit['problems'])}. "
                     f"No effN, effD are read from it.")
        fit['bootstrap'] = {}
        return '\n'.join(lines), fit
    noise, pooled = pooled_seed_sd(seed_losses)
    boot = bootstrap_eff(seed_losses, REFERENCE, fit['exponents'], fit['theta'], n_boot, noise_rel=noise or 0.0)
    lines += ['', '| recipe | effN ± SE (fit) | 95% (bootstrap) | effD ± SE (fit) '
              '| 95% (bootstrap) | Quartet (effN, effD) |', '|---|---|---|---|---|---|']
    for g in group_order(fit['eff']):
        (en, ed), (sn, sd), b = fit['eff'][g], fit['eff_se'][g], boot.get(g)
        ci = [f'[{lo:.3f}, {hi:.3f}]' for lo, hi in b] if b else ['one seed: none'] * 2
        pub = QUARTET_EFF.get(g)
        lines.append(f"| {g} | {en:.3f} ± {sn:.3f} | {ci[0]} | {ed:.3f} ± {sd:.3f} | {ci[1]} | "
                     f"{f'{pub[0]}, {pub[1]}' if pub else '—'} |")
    one_seed = {g: (sum(len(v) == 1 for k, v in seed_losses.items() if k[0] == g),
                    sum(k[0] == g for k in seed_losses)) for g in [REFERENCE, *fit['eff']]}
    counts = ', '.join(f'{g} {n} of {m}' for g, (n, m) in one_seed.items())
    lines.append(f'\nThe bootstrap ({n_boot} refits) draws seeds with replacement in the cells that have several, '
                 + (f'and draws the loss of a cell of one seed ({counts}) with the seed sd pooled over the '
                    f'{pooled} cells that have several: {100 * noise:.2f}% of the loss.' if noise else
                    f'and cannot vary a cell of one seed ({counts}): its interval is narrower than the seed noise.'))
    fit['bootstrap'] = boot
    return '\n'.join(lines), fit

def smooth(x, window):
    x = np.asarray(x, dtype=np.float64)
    if window <= 1 or len(x) < window:
        return x
    return np.convolve(x, np.ones(window) / window, mode='valid')

def plot_cell(size, tokens, groups, path):
    """Train loss (smoothed) with a min-max band over seeds, val points; the paired gap to
    bf16 in % from the smoothed train losses, with its band."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, (ax, axg) = plt.subplots(1, 2, figsize=(12, 4.5))
    ref = {s: r for s, r in groups.get(REFERENCE, {}).items() if r['status'] == 'ok'}
    lo_y, hi_y, gaps = math.inf, -math.inf, [0.0]
    for group in group_order(groups):
        runs = {s: r for s, r in groups[group].items() if r['status'] == 'ok'}
        if not runs:
            continue
        steps = len(next(iter(runs.values()))['curve']['train_loss'])
        tokens_a_step = tokens / steps
        w = max(1, steps // 40)
        curves = np.stack([smooth(r['curve']['train_loss'], w) for r in runs.values()])
        x = (np.arange(curves.shape[1]) + (w + 1) / 2) * tokens_a_step / 1e6  # window centres
        line, = ax.plot(x, curves.mean(0), lw=1.2, label=f'{group} ({len(runs)} seeds)')
        ax.fill_between(x, curves.min(0), curves.max(0), color=line.get_color(), alpha=0.25)
        vs = np.array(next(iter(runs.values()))['curve']['val_steps']) * tokens_a_step / 1e6
        vl = np.mean([r['curve']['val_loss'] for r in runs.values()], axis=0)
        ax.plot(vs, vl, 'o', color=line.get_color(), ms=4)
        tail = curves.mean(0)[len(x) // 5:]
        lo_y, hi_y = min(lo_y, tail.min()), max(hi_y, tail.max())
        pairs = [s for s in runs if s in ref]
        if group != REFERENCE and pairs:
            rel = np.stack([smooth(runs[s]['curve']['train_loss'], w) /
                            smooth(ref[s]['curve']['train_loss'], w) - 1 for s in pairs]) * 100
            axg.plot(x, rel.mean(0), color=line.get_color(), lw=1.2, label=f'{group} ({len(pairs)} pairs)')
            axg.fill_between(x, rel.min(0), rel.max(0), color=line.get_color(), alpha=0.25)
            gaps += [rel.min(0)[len(x) // 5:].min(), rel.max(0)[len(x) // 5:].max()]
    if np.isfinite(lo_y):
        ax.set_ylim(lo_y - 0.05 * (hi_y - lo_y + 0.1), hi_y + 0.05 * (hi_y - lo_y + 0.1))
    ax.set(xlabel='tokens (M)', ylabel='train loss (smoothed); dots: val',
           title=f'{size}, {tokens_label(tokens)} tokens: band = min..max over seeds')
    axg.axhline(0, color='k', lw=0.6)
    axg.set(xlabel='tokens (M)', ylabel=f'train loss / {REFERENCE} - 1 (%)',
            title='paired gap to bf16 (same seed), band = min..max over pairs')
    axg.set_ylim(min(gaps) - 0.5, max(gaps) + 0.5)  # the first fifth (warmup) may leave the frame
    for a in (ax, axg):
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

def plot_law(fit, records, path):
    """Per group: the seed-mean val loss of each (size, budget) the fit took, and the fitted law's
    curves."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    groups = [REFERENCE] + group_order(fit['eff'])
    fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 4), sharey=True, squeeze=False)
    size_of = {r['n_params']: r['model_size'] for r in records.values()}
    for ax, group in zip(axes[0], groups):
        en, ed = fit['eff'].get(group, (1.0, 1.0))
        for n in sorted({n for g, n, _ in fit['seed_losses'] if g == group}):
            pts = sorted((d, statistics.fmean(v.values())) for (g, n2, d), v in fit['seed_losses'].items()
                         if g == group and n2 == n)
            d = np.array([p[0] for p in pts])
            dd = np.geomspace(d.min() / 1.5, d.max() * 1.5, 50)
            line, = ax.plot(dd / 1e6, law_loss(n, dd, fit['params'], en, ed), lw=1)
            ax.plot(d / 1e6, [p[1] for p in pts], 'o', color=line.get_color(), label=size_of[n])
        ax.set(xscale='log', xlabel='tokens (M)', title=f'{group}: effN {en:.2f}, effD {ed:.2f}')
        for axis in (ax.xaxis.set_major_formatter, ax.xaxis.set_minor_formatter):
            axis(matplotlib.ticker.FuncFormatter(lambda v, _: f'{v:g}'))  # 20, not 2x10^1
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel('val loss; lines: the fitted law')
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

def published_law_gaps(rows):
    """What Quartet's own law (its C4 fit with its effN, effD; SPEC.md 6) predicts for each measured
    cell of a recipe it has factors for: the gap at this N and D, beside the measured one."""
    out = []
    for r in rows:
        if r['group'] in QUARTET_EFF and r.get('gap'):
            n, d = r['n_params'], r['tokens']
            pred = law_loss(n, d, QUARTET_LAW, *QUARTET_EFF[r['group']]) / law_loss(n, d, QUARTET_LAW) - 1
            out.append(f"{r['group']} at {r['size']}, {tokens_label(d)}: {100 * pred:+.2f}% predicted, "
                       f"{fmt_gap(r['gap'])[0]} measured {fmt_gap(r['gap'])[1]}")
    return ("Quartet's published law (C4 constants, effN 0.658, effD 0.822) at these N and D: "
            + ('; '.join(out) if out else 'no quartet cell with a gap yet') + '.')

def report(directory, exponents='auto', n_boot=200, log=print, min_tokens_per_param=0.0):
    """Write directory/report.md (the tables docs/accuracy.md includes), report.json and the PNGs;
    the law is fitted to the cells at min_tokens_per_param or more."""
    records = load_records(directory)
    if not records:
        raise FileNotFoundError(f'no run JSONs in {directory}: run `python study/study.py run` first')
    rows = gap_rows(records)
    law_md, fit = law_section(records, exponents, n_boot, min_tokens_per_param)
    cells = by_cell(records)
    pngs = []
    for (size, tokens), groups in cells.items():
        name = f'curves_{size}_{tokens_label(tokens)}.png'
        plot_cell(size, tokens, groups, os.path.join(directory, name))
        pngs.append(name)
    if fit and not fit['problems']:
        plot_law(fit, records, os.path.join(directory, 'law.png'))
        pngs.append('law.png')
    if fit:
        del fit['seed_losses']
    noise = [f"{r['size']} {tokens_label(r['tokens'])}: seed sd {r['sd']:.4f} ({fmt_eval(r)}"
             + (f"; the training's alone ~{math.sqrt(max(0.0, r['sd'] ** 2 - r['eval_se'] ** 2)):.4f}"
                if r['eval'] == 'batches' else '') + ')'
             for r in rows if r['group'] == REFERENCE and np.isfinite(r['sd'])]
    commits = sorted({c for r in rows for c in r['commits']})
    corpora = sorted({c for r in rows for c in r['corpora']})
    variants = [r for r in rows if r.get('vs_base')]
    md = ['Val loss after the same tokens, per recipe; gap = mean over seeds of L(recipe, seed) / '
          'L(bf16, seed) - 1, the runs paired by seed (same init, data order and eval batches); '
          '95% interval = Student t on those paired gaps (n - 1 degrees of freedom). eval: '
          '"whole split" = the loss over the same val text for every run (train.py eval_split_tokens); '
          '"per-seed batches" = the last eval\'s random batches, drawn by the seed (the runs of a seed '
          'share them), with SE = the standard error of one val loss over them (median over seeds): '
          'across seeds that sampling adds to the spread, within a seed\'s pair it cancels. '
          'tokens/s: the runs\' median, often with other runs sharing the GPU (study.py --jobs, or '
          'several studies at once): how long runs took, not a speed measurement (bench.py is).', '',
          gap_table(rows), '']
    if variants:
        md += ['Variants against their own recipe: the run of it whose flags differ by the fewest (what those '
               'flags change; the plain recipe where none is closer), or, for an ablation, its '
               f'`+{WHOLE}` variant (what leaving that part out costs); and an `_fp4` variant against its '
               'twin without FP4 (root_fp4 against root), paired by seed:', '',
               '| size | tokens | variant | against | gap | 95% interval | twin | gap to twin | 95% interval |',
               '|---|---|---|---|---|---|---|---|---|']
        for r in variants:
            cells = ((r['base'],) + gap_cells(r['vs_base'], r['base'], r, rows) + (r.get('twin', '—'),)
                     + gap_cells(r.get('vs_twin'), r.get('twin'), r, rows))
            md.append(f"| {r['size']} | {tokens_label(r['tokens'])} | {r['group']} | {' | '.join(cells)} |")
        md += ['', '(sd: the seed sd of what the gap is against, relative to its mean; "within" where the '
               'mean gap is no larger: the issues\' "within the seed spread")']
        md.append('')
    md += [equal_coverage_table(records), curve_gap_table(records)]
    md += [f'Published: {PUBLISHED}.', '', published_law_gaps(rows), '',
           'Eval noise beside seed noise (bf16): ' + ('; '.join(noise) or 'needs >= 2 seeds') + '.', '',
           rerun_table(directory, records),
           law_md, '', 'Plots: ' + ', '.join(f'`{p}`' for p in pngs) + '.',
           f"Code: {', '.join(c[:10] for c in commits)}; corpus (train.bin SHA-1): "
           f"{', '.join(c[:10] for c in corpora)}" + (' (MIXED: runs from different corpora)'
                                                     if len(corpora) > 1 else '') + '.']
    text = '\n'.join(md) + '\n'
    with open(os.path.join(directory, 'report.md'), 'w') as f:
        f.write(text)
    if fit:
        fit = {k: v for k, v in fit.items() if k != 'theta'}
    write_json(os.path.join(directory, 'report.json'), dict(rows=rows, law=fit))
    log(text)
    return rows, fit
