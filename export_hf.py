"""
Export a train.py checkpoint as a Hugging Face LlamaForCausalLM folder.

$ python export_hf.py out/ckpt.pt out/hf                 # the FP32 master weights
$ python export_hf.py out/ckpt.pt out/hf --fp4-weights   # what the FP4 forward multiplied by

Writes config.json, generation_config.json, model.safetensors (FP32) and, for a tiktoken
corpus such as cl100k_base, tokenizer.json + tokenizer_config.json, so that
AutoTokenizer.from_pretrained and LlamaForCausalLM.from_pretrained load the folder.
Prompts should start with <|endoftext|>, as every training document did.

How model.py maps onto HF Llama:
- qkv is fused with rows [q | k | v] (n_head, n_kv_head, n_kv_head heads): split into
  q_proj, k_proj, v_proj; gate_up is [gate | up]: gate_proj, up_proj.
- RoPE: model.py rotates the pairs (x[i], x[i + head_size/2]), HF's rotate_half convention,
  with the same frequencies theta^(-2i/head_size): rope_theta as is, no row permutation.
- RMSNorm: the same formula (mean of squares in FP32, then the weight): rms_norm_eps = norm_eps.
- lm_head is untied (tie_word_embeddings false); GQA via num_key_value_heads.
- The vocabulary stays padded (a multiple of 128, e.g. 100352 for cl100k's 100277 ids):
  the embedding rows past the tokenizer's ids are exported too, so logits match.

--fp4-weights exports, for the blocks the recipe runs in FP4, the weight the FP4 forward
used, in the input's basis. quartet's forward is Y = Q(XH) Q(WH)^T (SPEC 5) with H the
orthogonal, symmetric block Hadamard matrix, so Y = [deq Q(XH) H^T] [deq Q(WH) H^T]^T and W's
part is deq(Q(WH)) H^T = hadamard(deq(Q(WH))). nvfp4 and quartet2 do not rotate in the
forward: deq(Q(W)), with their 16x16 tiles or four-over-six scales and tensor scale. fullstack
quantizes R = W - L and adds its BF16 rank-r part L (SPEC 8.4): deq(Q(R)) + L. The
activations stay unquantized on the HF side. Without --fp4-weights, fullstack's L is not
exported on its own: the master W is L + R already.
"""

import argparse
import json
import os
import sys

import torch

import checkpoint
from model import fp4_blocks

# -----------------------------------------------------------------------------
# config.json

def hf_config(args, meta):
    """LlamaForCausalLM's config for model.py's GPTConfig fields (the checkpoint's model_args)."""
    eot = meta.get('eot_token')
    theta = float(args['rope_theta'])
    return dict(
        architectures=['LlamaForCausalLM'], model_type='llama',
        vocab_size=args['vocab_size'], hidden_size=args['n_embd'],
        intermediate_size=args['ffn_hidden'], num_hidden_layers=args['n_layer'],
        num_attention_heads=args['n_head'], num_key_value_heads=args['n_kv_head'],
        head_dim=args['n_embd'] // args['n_head'], hidden_act='silu',
        max_position_embeddings=args['block_size'], rms_norm_eps=args['norm_eps'],
        rope_theta=theta,  # transformers < 5 reads this, 5 reads rope_parameters
        rope_parameters=dict(rope_type='default', rope_theta=theta),
        attention_bias=False, mlp_bias=False, attention_dropout=0.0, tie_word_embeddings=False,
        bos_token_id=eot, eos_token_id=eot, torch_dtype='float32', use_cache=True,
        initializer_range=0.02, pretraining_tp=1)

# -----------------------------------------------------------------------------
# weights

def fp4_forward_weight(w, recipe, low=None):
    """(N, K) weight -> the FP32 weight the recipe's FP4 forward multiplies by (see the top).
    low: fullstack's L = U_r S_r V_r^T (N, K), or None: the forward quantizes R = W - L and adds
    L's product in BF16, so its weight is deq(Q(R)) + L."""
    import fp4
    r = fp4.RECIPES[recipe]
    spec = r['w']
    if spec.get('signs') is not None:  # a signed rotation is not its own inverse
        raise SystemExit(f'--fp4-weights: recipe {recipe!r} rotates W with random signs in the '
                         f'forward, which export_hf.py does not undo')
    w = w.float() if low is None else w.float() - low
    wq = fp4.dequantize(fp4.quantize(w, r['fmt'], **spec))  # deq(Q(W H)), still rotated
    n = spec.get('hadamard', 0)
    wq = fp4.hadamard(wq, n) if n else wq  # H^T = H, orthogonal: back to the input's basis
    return wq if low is None else wq + low

def hf_tensors(state, args, recipe, fp4_weights, path):
    """{HF name: FP32 tensor}. Every entry of the checkpoint's model is used exactly once:
    one this mapping does not know (e.g. another branch's LoRA parts) stops the export."""
    sd = dict(state)
    def take(key):
        if key not in sd:
            raise SystemExit(f'{path}: the model has no {key}: not a model.py checkpoint')
        return sd.pop(key).float()
    L, nh, nkv = args['n_layer'], args['n_head'], args['n_kv_head']
    hs = args['n_embd'] // nh
    in_fp4 = set(fp4_blocks(L, recipe, args.get('end_blocks', 'auto'))) if fp4_weights else set()
    def linear(i, name):
        key = f'transformer.h.{i}.{name}'
        w = take(key + '.weight')  # (out_features, in_features)
        low = None
        if key + '.lora_us' in sd:  # fullstack: W = L + R, and W, the master, already holds L
            low = take(key + '.lora_us') @ take(key + '.lora_v').t()  # (N, r) @ (r, K)
        return fp4_forward_weight(w, recipe, low) if i in in_fp4 else w
    out = {'model.embed_tokens.weight': take('transformer.wte.weight')}
    for i in range(L):
        p = f'model.layers.{i}.'
        q, k, v = linear(i, 'attn.qkv').split([nh * hs, nkv * hs, nkv * hs])
        gate, up = linear(i, 'mlp.gate_up').chunk(2)
        out.update({p + 'self_attn.q_proj.weight': q, p + 'self_attn.k_proj.weight': k,
                    p + 'self_attn.v_proj.weight': v, p + 'self_attn.o_proj.weight': linear(i, 'attn.o'),
                    p + 'mlp.gate_proj.weight': gate, p + 'mlp.up_proj.weight': up,
                    p + 'mlp.down_proj.weight': linear(i, 'mlp.down'),
                    p + 'input_layernorm.weight': take(f'transformer.h.{i}.ln_1.weight'),
                    p + 'post_attention_layernorm.weight': take(f'transformer.h.{i}.ln_2.weight')})
    out['model.norm.weight'] = take('transformer.ln_f.weight')
    out['lm_head.weight'] = take('lm_head.weight')
    if sd:
        raise SystemExit(f"{path}: the model holds entries export_hf.py cannot map onto Llama "
                         f"({', '.join(sorted(sd)[:4])}{', ...' if len(sd) > 4 else ''})")
    return {k: t.contiguous().clone() for k, t in out.items()}  # safetensors: no shared storage

# -----------------------------------------------------------------------------
# tokenizer: a tiktoken encoding as a Hugging Face tokenizer.json

def byte_chars():
    """The byte-level alphabet of HF's BPE tokenizers: each byte as one printable character
    (printable ASCII and Latin-1 stand for themselves, the other bytes are moved to 256+)."""
    keep = [*range(ord('!'), ord('~') + 1), *range(ord('¡'), ord('¬') + 1), *range(ord('®'), 256)]
    moved = [b for b in range(256) if b not in keep]
    table = {b: chr(b) for b in keep}
    table.update({b: chr(256 + i) for i, b in enumerate(moved)})
    return table

def tiktoken_json(enc):
    """tokenizer.json for a tiktoken Encoding: byte-level BPE, same ids, same splits.
    tiktoken's merge rank is the rank of the merged token, so every way to split a token into
    two tokens is listed as a merge at the token's rank (pieces by rank within it): HF then
    joins adjacent pieces in the order tiktoken does. Special tokens keep their ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    ranks, chars = enc._mergeable_ranks, byte_chars()
    text = lambda b: ''.join(chars[x] for x in b)  # noqa: E731
    merges = []
    for token, rank in ranks.items():
        splits = [(ranks[token[:i]], ranks[token[i:]], i) for i in range(1, len(token))
                  if token[:i] in ranks and token[i:] in ranks]
        merges += [(rank, text(token[:i]), text(token[i:])) for _, _, i in sorted(splits)]
    merges.sort(key=lambda m: m[0])
    vocab = {text(b): r for b, r in ranks.items()} | dict(enc._special_tokens)
    tok = Tokenizer(models.BPE(vocab, [(a, b) for _, a, b in merges], ignore_merges=True))
    # Oniguruma reads "{1,3}+" as "one or more of {1,3}", not as possessive: drop the "+"
    # (the same matches here, as nothing follows inside that alternative)
    pattern = enc._pat_str.replace('}+', '}')
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior='isolated'),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in enc._special_tokens])
    return tok

def write_tokenizer(meta, out_dir, max_len, model_vocab=None):
    """tokenizer.json and tokenizer_config.json for the corpus's tiktoken encoding. Returns
    what was done, for the message."""
    from sample import tiktoken_encoding
    name = meta.get('encoding')
    enc = tiktoken_encoding(name)
    if enc is None:
        return (f'no tokenizer written: the corpus encoding {name!r} is not a tiktoken one; '
                f'pair the model with the tokenizer that made the corpus')
    os.makedirs(out_dir, exist_ok=True)
    tiktoken_json(enc).save(os.path.join(out_dir, 'tokenizer.json'))
    eot = enc.decode([enc.eot_token])
    cfg = dict(tokenizer_class='PreTrainedTokenizerFast', bos_token=eot, eos_token=eot,
               unk_token=None, model_max_length=max_len, clean_up_tokenization_spaces=False)
    with open(os.path.join(out_dir, 'tokenizer_config.json'), 'w') as f:
        json.dump(cfg, f, indent=1)
    return f'tokenizer.json: {name}, {enc.n_vocab} ids (the model\'s vocabulary: {model_vocab})'

# -----------------------------------------------------------------------------
# the export

def export(ckpt_path, out_dir, fp4_weights=False):
    """Write the HF folder; returns the list of lines to print."""
    from safetensors.torch import save_file
    try:
        ckpt = checkpoint.read(ckpt_path)
        recipe = checkpoint.recipe_of(ckpt, ckpt_path)
    except checkpoint.CheckpointError as e:
        raise SystemExit(str(e))
    if fp4_weights and recipe in ('bf16', 'float8'):
        raise SystemExit(f'--fp4-weights: {ckpt_path} was trained with recipe {recipe}, which has no '
                         f'FP4 layers: export without --fp4-weights')
    args, meta = ckpt['model_args'], checkpoint.meta_of(ckpt)
    tensors = hf_tensors(ckpt['model'], args, recipe, fp4_weights, ckpt_path)
    os.makedirs(out_dir, exist_ok=True)
    config = hf_config(args, meta)
    with open(os.path.join(out_dir, 'config.json'), 'w') as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(out_dir, 'generation_config.json'), 'w') as f:
        json.dump(dict(bos_token_id=config['bos_token_id'], eos_token_id=config['eos_token_id']), f)
    which = f'the FP4 forward weights of recipe {recipe}' if fp4_weights else 'the FP32 master weights'
    save_file(tensors, os.path.join(out_dir, 'model.safetensors'),
              metadata=dict(format='pt', source=os.path.abspath(ckpt_path), recipe=recipe,
                            weights='fp4_forward' if fp4_weights else 'master'))
    return [f'{out_dir}: LlamaForCausalLM, {which}, {len(tensors)} tensors',
            write_tokenizer(meta, out_dir, args['block_size'], args['vocab_size'])]

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.strip().split('\n\n')[0])
    parser.add_argument('ckpt', help='a train.py checkpoint, e.g. out/ckpt.pt')
    parser.add_argument('out_dir', help='the folder to write, e.g. out/hf')
    parser.add_argument('--fp4-weights', action='store_true',
                        help="export the FP4 forward's dequantized weights instead of the masters")
    a = parser.parse_args(sys.argv[1:] if argv is None else argv)
    for line in export(a.ckpt, a.out_dir, a.fp4_weights):
        print(line)

if __name__ == '__main__':
    main()
