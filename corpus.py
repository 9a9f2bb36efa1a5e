"""
corpus.py: reading a prepared corpus, checked. data/<name>/prepare.py writes a folder with
train.bin and val.bin (uint32 token ids, one after another) and meta.json (vocab_size, the
tokenizer's name, eot_token); train.py memmaps them through load(). The default corpus,
data/pycode, is prepared on first use.

Each way a folder cannot be used (missing, truncated, another dtype, an id outside the
vocabulary, too short for one batch) ends in one line that says how to make it again.
"""
import importlib.util
import json
import os

import numpy as np
import torch.distributed as dist


def load(path, name, own_dir, block_size, master, log=print):
    """({'train': memmap, 'val': memmap}, meta) of the corpus in path. name is its data/<name>
    folder; own_dir: path was given by the user (data_dir), so nothing is prepared there."""
    redo = remake_hint(path if own_dir else '', name)
    if not os.path.exists(os.path.join(path, 'train.bin')):
        if own_dir or name != 'pycode':
            raise SystemExit(f'{path}/train.bin not found: run data/{name}/prepare.py, or point '
                             f'--data_dir at the folder with train.bin, val.bin and meta.json')
        if master:
            log(f'{path}/train.bin not found: preparing the default corpus (Python sources)')
            script = os.path.join(path, 'prepare.py')  # a script, not a package: load by path
            spec = importlib.util.spec_from_file_location('pycode_prepare', script)
            prepare = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(prepare)
            prepare.prepare(path)
        if dist.is_initialized():
            dist.barrier()  # the other ranks wait for the files
    meta = read_meta(path, redo)
    data = {s: read_bin(os.path.join(path, f'{s}.bin'), meta['vocab_size'], block_size, redo)
            for s in ('train', 'val')}
    return data, meta


def remake_hint(data_dir, name):
    if data_dir:
        return (f'make {data_dir} again (train.bin, val.bin: uint32 token ids; meta.json: '
                f'vocab_size), e.g. with data/<name>/prepare.py')
    return f'run data/{name}/prepare.py again'


def read_meta(path, redo):
    """meta.json, checked: the vocabulary size, and uint32 ids (what prepare.py writes)."""
    fn = os.path.join(path, 'meta.json')
    try:
        with open(fn) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise SystemExit(f'{fn} not found: it gives the vocabulary size of the .bin files; {redo}')
    except (OSError, ValueError) as e:
        raise SystemExit(f'{fn} is not readable JSON ({e}): {redo}')
    if not isinstance(meta, dict) or not isinstance(meta.get('vocab_size'), int):
        raise SystemExit(f'{fn} has no integer vocab_size: {redo}')
    if meta.get('dtype', 'uint32') != 'uint32':
        raise SystemExit(f"{fn} says the token ids are {meta['dtype']}; train.py reads uint32 "
                         f'(4 bytes a token): {redo}')
    return meta


def read_bin(fn, vocab, block_size, redo):
    """A read-only memmap of uint32 token ids, after checking that the file is whole tokens,
    long enough for a batch, and holds no id outside the vocabulary (the embedding would
    fail on it mid-run, on a GPU as a device-side assert)."""
    if not os.path.exists(fn):
        raise SystemExit(f'{fn} not found: {redo}')
    size = os.path.getsize(fn)
    if size % 4:
        raise SystemExit(f'{fn} is {size} bytes, not a whole number of uint32 tokens (4 bytes '
                         f'each): it is truncated or was written with another dtype; {redo}')
    arr = np.memmap(fn, dtype=np.uint32, mode='r') if size else np.zeros(0, np.uint32)
    if len(arr) <= block_size + 1:
        raise SystemExit(f'{fn} has {len(arr)} tokens, fewer than block_size + 2 = {block_size + 2}: '
                         f'use more data or a smaller --block_size')
    chunk = 1 << 24  # 64 MiB at a time: bounded memory for multi-GB files
    top = max(int(arr[i:i + chunk].max()) for i in range(0, len(arr), chunk))
    if top >= vocab:
        raise SystemExit(f'{fn} holds token id {top}, but meta.json says vocab_size {vocab}: '
                         f'the .bin files and meta.json do not match; {redo}')
    return arr
