"""
records.py: the accuracy study's run records, one JSON a run in results/<gpu>/study/, as study.py
writes them and analysis.py reads them.
"""
import json
import os

# settings whose every value makes the same run: compile_mode changes how fast the same kernels
# are launched (CUDA graphs or not), not what they compute; checkpoint_steps and keep_checkpoints
# which checkpoints an FP4 run leaves for its BF16 tails to branch from (study.py)
LAUNCH_ONLY = ('compile_mode', 'checkpoint_steps', 'keep_checkpoints')


def tokens_label(tokens):
    for unit, scale in (('B', 1e9), ('M', 1e6), ('K', 1e3)):
        if tokens >= scale:
            return f'{tokens / scale:.4g}{unit}'
    return f'{tokens:g}'


def load_records(directory):
    """{run id: record} of every run JSON in directory."""
    records = {}
    if os.path.isdir(directory):
        for fn in sorted(os.listdir(directory)):
            if fn.endswith('.json') and fn != 'report.json':
                with open(os.path.join(directory, fn)) as f:
                    rec = json.load(f)
                records[rec['id']] = rec
    return records


def write_json(path, obj):
    with open(path + '.tmp', 'w') as f:
        json.dump(obj, f, indent=1)
    os.replace(path + '.tmp', path)


def reruns_of(repeats_dir, run_id):
    """The reruns of run_id that merge kept in repeats_dir (in name order)."""
    if not os.path.isdir(repeats_dir):
        return []
    out = []
    for fn in sorted(os.listdir(repeats_dir)):
        if fn.startswith(run_id + '.') and fn.endswith('.json'):
            with open(os.path.join(repeats_dir, fn)) as f:
                out.append(json.load(f))
    return out
