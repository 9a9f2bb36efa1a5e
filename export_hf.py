"""
Export a train.py checkpoint as a Hugging Face LlamaForCausalLM folder.

$ python export_hf.py out/ckpt.pt out/hf                 # the master weights, in BF16
$ python export_hf.py out/ckpt.pt out/hf --dtype float32 # the same, in FP32 (as trained)
$ python export_hf.py out/ckpt.pt out/hf --fp4-weights   # what the FP4 forward multiplied by
$ python export_hf.py out/ckpt.pt out/hf --fp4-packed    # that, packed (nvfp4, quartet2)

Writes config.json, generation_config.json, model.safetensors (BF16, as a Hugging Face
Llama ships, or FP32 with --dtype float32) and, for a tiktoken
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

--fp4-packed writes the FP4 blocks' linears in compressed-tensors' nvfp4-pack-quantized
format (transformers loads it, vLLM serves it): weight_packed (E2M1 codes, two a byte),
weight_scale (E4M3, one per 1x16 group) and weight_global_scale (FP32, 1/g), named in
config.json's quantization_config as NVFP4 weights with unquantized activations; the rest
(embeddings, norms, lm_head, blocks the recipe kept in BF16) in BF16. compressed-tensors
decompresses to BF16: the loaded weights are the --fp4-weights ones rounded to BF16, bit for
bit. nvfp4 and quartet2 only: fullstack's W = L + R and quartet's rotated MXFP4 are refused
(see REFUSED). docs/export.md has the measurements.
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

def hf_config(args, meta, dtype):
    """LlamaForCausalLM's config for model.py's GPTConfig fields (the checkpoint's model_args);
    dtype: the weights' ('bfloat16' or 'float32')."""
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
        bos_token_id=eot, eos_token_id=eot, torch_dtype=dtype, use_cache=True,
        initializer_range=0.02, pretraining_tp=1)

# -----------------------------------------------------------------------------
# weights

def fp4_forward_qtensor(w, recipe, low=None):
    """(N, K) weight -> the QTensor the recipe's FP4 forward quantizes: Q(W H) for quartet,
    Q(W) for nvfp4 and quartet2 (their 16x16 tiles or four-over-six scales), Q(R), R = W - L,
    for fullstack (low: its L = U_r S_r V_r^T, (N, K))."""
    import fp4
    import linear
    r = linear.RECIPES[recipe]
    spec = r['w']
    if spec.get('signs') is not None:  # a signed rotation is not its own inverse
        raise SystemExit(f'recipe {recipe!r} rotates W with random signs in the forward, '
                         f'which export_hf.py does not undo')
    w = w.float() if low is None else w.float() - low
    return fp4.quantize(w, r['fmt'], **spec)

def fp4_forward_weight(w, recipe, low=None):
    """(N, K) weight -> the FP32 weight the recipe's FP4 forward multiplies by (see the top).
    low: fullstack's L, or None: the forward quantizes R = W - L and adds L's product in BF16,
    so its weight is deq(Q(R)) + L."""
    import fp4
    import linear
    wq = fp4.dequantize(fp4_forward_qtensor(w, recipe, low))  # deq(Q(W H)), still rotated
    n = linear.RECIPES[recipe]['w'].get('hadamard', 0)
    wq = fp4.hadamard(wq, n) if n else wq  # H^T = H, orthogonal: back to the input's basis
    return wq if low is None else wq + low

LLAMA_LINEARS = ('self_attn.q_proj', 'self_attn.k_proj', 'self_attn.v_proj', 'self_attn.o_proj',
                 'mlp.gate_proj', 'mlp.up_proj', 'mlp.down_proj')

def hf_tensors(state, args, recipe, weights, path):
    """{HF name: tensor}, weights: 'master' (FP32), 'fp4' (the FP4 forward's weights, FP32) or
    'packed' (those, for the FP4 blocks, as compressed-tensors' packed tensors: see below).
    Every entry of the checkpoint's model is used exactly once: one this mapping does not know
    (e.g. another branch's LoRA parts) stops the export."""
    sd = dict(state)
    def take(key):
        if key not in sd:
            raise SystemExit(f'{path}: the model has no {key}: not a model.py checkpoint')
        return sd.pop(key).float()
    L, nh, nkv = args['n_layer'], args['n_head'], args['n_kv_head']
    hs, ffn = args['n_embd'] // nh, args['ffn_hidden']
    in_fp4 = set(fp4_blocks(L, recipe, args.get('end_blocks', 'auto'))) if weights != 'master' else set()
    def linear(i, name):  # {suffix: tensor} of one model.py linear
        key = f'transformer.h.{i}.{name}'
        w = take(key + '.weight')  # (out_features, in_features)
        low = None
        if key + '.lora_us' in sd:  # fullstack: W = L + R, and W, the master, already holds L
            low = take(key + '.lora_us') @ take(key + '.lora_v').t()  # (N, r) @ (r, K)
        if i not in in_fp4:
            return dict(weight=w)
        if weights == 'packed':
            return pack_qtensor(fp4_forward_qtensor(w, recipe, low))
        return dict(weight=fp4_forward_weight(w, recipe, low))
    out = {'model.embed_tokens.weight': take('transformer.wte.weight')}
    for i in range(L):
        p = f'model.layers.{i}.'
        q, k, v, o, gate, up, down = (p + m for m in LLAMA_LINEARS)
        mods = dict(zip((q, k, v), split_rows(linear(i, 'attn.qkv'), [nh * hs, nkv * hs, nkv * hs])))
        mods.update(zip((gate, up), split_rows(linear(i, 'mlp.gate_up'), [ffn, ffn])))
        mods.update({o: linear(i, 'attn.o'), down: linear(i, 'mlp.down')})
        out.update({f'{m}.{suffix}': t for m, parts in mods.items() for suffix, t in parts.items()})
        out.update({p + 'input_layernorm.weight': take(f'transformer.h.{i}.ln_1.weight'),
                    p + 'post_attention_layernorm.weight': take(f'transformer.h.{i}.ln_2.weight')})
    out['model.norm.weight'] = take('transformer.ln_f.weight')
    out['lm_head.weight'] = take('lm_head.weight')
    if sd:
        raise SystemExit(f"{path}: the model holds entries export_hf.py cannot map onto Llama "
                         f"({', '.join(sorted(sd)[:4])}{', ...' if len(sd) > 4 else ''})")
    return {k: t.contiguous().clone() for k, t in out.items()}  # safetensors: no shared storage

def split_rows(tensors, sizes):
    """{suffix: tensor} of a fused linear (qkv, gate_up) -> one such dict per HF projection:
    tensors with a row per output feature (weight, packed codes, block scales) are split by
    rows; a per-tensor one (the global scale) goes to every part, as the fused forward used it."""
    parts = [{} for _ in sizes]
    for suffix, t in tensors.items():
        for part, piece in zip(parts, t.split(sizes) if t.dim() == 2 else [t] * len(sizes)):
            part[suffix] = piece
    return parts

# -----------------------------------------------------------------------------
# --fp4-packed: the FP4 blocks' weights in compressed-tensors' packed format

PACKED_FORMAT = 'nvfp4-pack-quantized'
PACKED_RECIPES = ('nvfp4', 'quartet2')  # NVFP4 weights: 1x16 blocks, E4M3 scales, FP32 tensor scale
REFUSED = {
    'fullstack': "recipe fullstack multiplies by W = L + R, a BF16 rank-r part plus an NVFP4 "
                 "residual, and compressed-tensors has no added low-rank term beside a packed "
                 "weight: export with --fp4-weights (deq(Q(R)) + L, dense)",
    'quartet': "recipe quartet's FP4 weights are MXFP4 of W H (Hadamard-32 rotated), so the "
               "activations must be rotated online too: compressed-tensors can write that rotation "
               "(its transform_config) but transformers drops transform_config when it loads a "
               "folder, which would then compute wrong outputs: export with --fp4-weights",
}

def packed_scheme():
    """NVFP4 weights, activations left as they are (W4A16): the FP4 forward's weights, with
    the same activations as the --fp4-weights export (the training forward's activation
    scale is dynamic per tensor; compressed-tensors' W4A4 NVFP4 wants a calibrated one)."""
    from compressed_tensors.quantization import preset_name_to_scheme
    scheme = preset_name_to_scheme('NVFP4A16', ['Linear'])
    scheme.format = PACKED_FORMAT
    return scheme

def packed_config(args, recipe):
    """compressed-tensors' quantization_config: every Linear of the FP4 blocks packed, the
    others (lm_head, and the blocks the recipe kept in BF16) named in `ignore`."""
    from compressed_tensors.quantization import QuantizationConfig
    L = args['n_layer']
    in_fp4 = set(fp4_blocks(L, recipe, args.get('end_blocks', 'auto')))
    ignore = [f'model.layers.{i}.{m}' for i in range(L) if i not in in_fp4 for m in LLAMA_LINEARS]
    return QuantizationConfig(config_groups={'group_0': packed_scheme()}, format=PACKED_FORMAT,
                              quantization_status='compressed', ignore=ignore + ['lm_head'])

def pack_qtensor(q):
    """An (N, K) NVFP4 QTensor -> compressed-tensors' tensors for its linear: the E2M1 codes
    packed two a byte by compressed-tensors (uint8 (N, K/2)), the block scales as they are
    (E4M3 (N, K/16); nvfp4's 16x16 tiles already repeat theirs on the tile's 16 rows) and
    the global scale (FP32 (1,), see global_scale)."""
    return ct_tensors(q, global_scale(q.tensor_scale))

def ct_tensors(q, gs):
    """q's codes, scales and the global scale gs under compressed-tensors' parameter names."""
    import fp4
    from compressed_tensors.compressors import NVFP4PackedCompressor, pack_fp4_to_uint8
    packed, scale, global_ = NVFP4PackedCompressor.compression_param_names(packed_scheme())
    codes = fp4.e2m1_decode(fp4.unpack(q.codes))  # the E2M1 values (N, K), -0 kept
    return {packed: pack_fp4_to_uint8(codes), scale: q.scales.view(torch.float8_e4m3fn),
            global_: gs.reshape(1)}

def global_scale(g):
    """compressed-tensors' weight_global_scale for SPEC's tensor scale g (SPEC 2): it divides
    the block scales by it where SPEC multiplies by g, so it is 1/g. Its decompressor rounds
    code * (s_b / gs) to BF16; the FP32 nearest 1/g gives bf16(code * s_b * g) for every code
    and E4M3 scale unless g sits near a BF16 rounding midpoint, where a float a few steps away
    does: the first of 1/g and its 8 neighbours each side that reproduces them all is taken.
    A g of few significant bits (3.5, say) can put code * s_b * g exactly halfway between two
    BF16 numbers, a tie no FP32 divisor reproduces both ways: then the one with the fewest
    differences, each such a tie rounded to the other, equally near, BF16 neighbour."""
    table = every_code_and_scale(g)
    tried = []
    for gs in floats_near((1 / g).float(), 8):
        tried.append((mismatches(table, gs), gs))
        if tried[-1][0] == 0:
            break
    return min(tried, key=lambda t: t[0])[1]

def every_code_and_scale(g):
    """An NVFP4 QTensor (127, 16) with tensor scale g: a row for every finite E4M3 scale
    (bits 0..126), each row one block holding the 16 E2M1 codes."""
    import fp4
    codes = fp4.pack(torch.arange(16, dtype=torch.uint8)).expand(127, 8)
    return fp4.QTensor(codes, torch.arange(127, dtype=torch.uint8).view(127, 1), g, 'nvfp4', (127, 16), 1)

def ct_dequantize(q, gs):
    """compressed-tensors' decompressor on q's codes and scales with global scale gs (BF16)."""
    from compressed_tensors.compressors import NVFP4PackedCompressor
    return NVFP4PackedCompressor.decompress(ct_tensors(q, gs), packed_scheme())['weight']

def mismatches(q, gs):
    """How many of ct_dequantize(q, gs) differ, bit for bit, from q's values rounded to BF16."""
    import fp4
    got, want = ct_dequantize(q, gs), fp4.dequantize(q).bfloat16()
    return int((got.view(torch.int16) != want.view(torch.int16)).sum())

def floats_near(x, n):
    """The FP32 0-d tensor x and the n floats each side of it, nearest first."""
    out, up, down = [x], x, x
    for _ in range(n):
        up, down = torch.nextafter(up, up.new_tensor(float('inf'))), torch.nextafter(down, down.new_tensor(0.0))
        out += [up, down]
    return out

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

DTYPES = {'bfloat16': torch.bfloat16, 'float32': torch.float32}

def export(ckpt_path, out_dir, fp4_weights=False, fp4_packed=False, dtype='bfloat16'):
    """Write the HF folder, its weights in dtype (the packed tensors keep their own); returns
    the list of lines to print."""
    from safetensors.torch import save_file
    if fp4_packed and dtype != 'bfloat16':  # compressed-tensors decompresses to BF16
        raise SystemExit(f'--fp4-packed writes the other weights in bfloat16, the dtype its packed '
                         f'linears decompress to, not {dtype}: leave out --dtype')
    try:
        ckpt = checkpoint.read(ckpt_path)
        recipe = checkpoint.recipe_of(ckpt, ckpt_path)
    except checkpoint.CheckpointError as e:
        raise SystemExit(str(e))
    weights = 'packed' if fp4_packed else 'fp4' if fp4_weights else 'master'
    check_recipe(recipe, weights, ckpt_path)
    args, meta = ckpt['model_args'], checkpoint.meta_of(ckpt)
    tensors = hf_tensors(ckpt['model'], args, recipe, weights, ckpt_path)
    os.makedirs(out_dir, exist_ok=True)
    config = hf_config(args, meta, dtype)
    # the weights in dtype; packed: the codes, scales and global scales keep their own dtypes
    tensors = {k: t.to(DTYPES[dtype]) if k.endswith('.weight') else t for k, t in tensors.items()}
    with open(os.path.join(out_dir, 'config.json'), 'w') as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(out_dir, 'generation_config.json'), 'w') as f:
        json.dump(dict(bos_token_id=config['bos_token_id'], eos_token_id=config['eos_token_id']), f)
    which = dict(master=f'the master weights in {dtype}',
                 fp4=f'the FP4 forward weights of recipe {recipe} in {dtype}',
                 packed=f'the FP4 forward weights of recipe {recipe}, packed ({PACKED_FORMAT})')[weights]
    save_file(tensors, os.path.join(out_dir, 'model.safetensors'),
              metadata=dict(format='pt', source=os.path.abspath(ckpt_path), recipe=recipe,
                            weights=dict(master='master', fp4='fp4_forward', packed='fp4_packed')[weights]))
    lines = [f'{out_dir}: LlamaForCausalLM, {which}, {len(tensors)} tensors']
    if fp4_packed:
        from compressed_tensors.compressors import ModelCompressor
        ModelCompressor(quantization_config=packed_config(args, recipe)).update_config(out_dir)
        lines.append(packed_size(tensors))
    return lines + [write_tokenizer(meta, out_dir, args['block_size'], args['vocab_size'])]

def check_recipe(recipe, weights, path):
    """Stop, with one line, an FP4 export the checkpoint's recipe cannot give."""
    flag = '--fp4-packed' if weights == 'packed' else '--fp4-weights'
    if weights != 'master' and recipe in ('bf16', 'float8'):
        raise SystemExit(f'{flag}: {path} was trained with recipe {recipe}, which has no '
                         f'FP4 layers: export without {flag}')
    if weights == 'packed' and recipe not in PACKED_RECIPES:
        raise SystemExit(f'--fp4-packed: {path}: {REFUSED[recipe]}')

def packed_size(tensors):
    """One line: the packed tensors' bytes against the BF16 bytes of the same weights."""
    packed = sum(t.numel() * t.element_size() for k, t in tensors.items()
                 if k.rsplit('.', 1)[1] in ('weight_packed', 'weight_scale', 'weight_global_scale'))
    bf16 = sum(2 * 2 * t.numel() for k, t in tensors.items() if k.endswith('.weight_packed'))
    return (f'packed linears: {packed / 2**20:.2f} MiB, {packed / bf16:.3f}x their BF16 bytes '
            f'({bf16 / 2**20:.2f} MiB)')

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.strip().split('\n\n')[0])
    parser.add_argument('ckpt', help='a train.py checkpoint, e.g. out/ckpt.pt')
    parser.add_argument('out_dir', help='the folder to write, e.g. out/hf')
    parser.add_argument('--fp4-weights', action='store_true',
                        help="export the FP4 forward's dequantized weights instead of the masters")
    parser.add_argument('--fp4-packed', action='store_true',
                        help=f"export the FP4 forward's weights packed ({PACKED_FORMAT}, compressed-tensors)")
    parser.add_argument('--dtype', choices=list(DTYPES), default='bfloat16',
                        help='the dense weights\' dtype (default bfloat16, as HF Llama ships; float32: '
                             'as trained, the FP4 forward weights unrounded)')
    a = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if a.fp4_weights and a.fp4_packed:
        parser.error('--fp4-weights and --fp4-packed are two exports: choose one')
    for line in export(a.ckpt, a.out_dir, a.fp4_weights, a.fp4_packed, a.dtype):
        print(line)

if __name__ == '__main__':
    main()
