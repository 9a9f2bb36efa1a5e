"""
runlog.py: what a training run writes beside its checkpoints, for a person and for a script.
train.log gets the command, versions, hardware and config at the start (header), then every
step; summary.json the final numbers and the loss curves; loss.png the curves drawn.
Only the master rank writes (open() is called there alone).
"""
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
_path = None  # out_dir/train.log on the master rank, set by open()


def open_log(path):
    global _path
    _path = path


def log(msg):
    """Print and append to train.log (the master rank only; the others stay silent)."""
    if _path is None:
        return
    print(msg, flush=True)
    with open(_path, 'a') as f:
        f.write(msg + '\n')


def git_state():
    """(commit, dirty) of the code that runs. FP4_GIT_COMMIT=<sha> names it where the checkout's
    .git is not the tree's own (a copy of a working tree sent to a GPU machine with a stale .git):
    then the tree is taken as that commit, clean."""
    if os.environ.get('FP4_GIT_COMMIT'):
        return os.environ['FP4_GIT_COMMIT'], False

    def git(*args):
        p = subprocess.run(['git', *args], cwd=HERE, capture_output=True, text=True, timeout=30)
        return p.stdout.strip() if p.returncode == 0 else None
    status = git('status', '--porcelain', '--untracked-files=no')
    return git('rev-parse', 'HEAD'), None if status is None else bool(status)


def header(config, backends):
    """What a run needs to be reproduced and compared: command, versions, hardware, config."""
    log(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(sys.argv)}")
    log(f'python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}, '
        f'{platform.platform()}')
    commit, dirty = git_state()
    log(f"git commit {commit or 'unknown'}{' (uncommitted changes)' if dirty else ''}")
    if config['device'].startswith('cuda'):
        log(f'GPU: {torch.cuda.get_device_name()} x {torch.cuda.device_count()}, CUDA {torch.version.cuda}')
    if shutil.which('nvidia-smi'):
        log(subprocess.run(['nvidia-smi'], capture_output=True, text=True, timeout=30).stdout)
    if config['recipe'] == 'float8':
        import torchao
        log(f'float8: torchao {torchao.__version__}, tensorwise scales')
    if backends:
        log(f'fp4 backends: {backends}')
    log('config: ' + json.dumps(config, sort_keys=True))


def peak_mem_gib(device):
    if device.startswith('cuda'):
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # peak RSS, KiB on Linux


def write_summary(out_dir, summary):
    with open(os.path.join(out_dir, 'summary.json'), 'w') as f:
        json.dump(summary, f, indent=1)
    split = summary.get('val_loss_split')
    log(f"val_loss={summary['val_loss']:.4f} tokens_per_s={summary['tokens_per_s']:.0f} "
        f"peak_mem_gib={summary['peak_mem_gib']:.3f}" + (f' val_loss_split={split:.4f}' if split is not None else ''))


def plot_losses(history, path, title):
    try:
        import matplotlib
        matplotlib.use('Agg')  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        log('matplotlib not installed: no loss.png')
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(history['steps'], history['train_loss'], lw=0.8, label='train (each step)')
    ax.plot(history['val_steps'], history['val_loss'], 'o-', label='val')
    ax.set(xlabel='step', ylabel='loss', title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
