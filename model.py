"""
A Llama-style decoder for FP4 pretraining, in one file, nanoGPT-like.
RMSNorm, rotary position embeddings (RoPE), causal SDPA attention with optional
grouped-query attention, SwiGLU MLP, untied lm_head.

The four linears of a block (qkv, o, gate_up, down) are plain nn.Linear here;
apply_recipe() swaps them for linear.FP4Linear. Embeddings, norms, RoPE, attention's
batched matmuls and the lm_head stay in high precision (SPEC.md 5), unless
attention='nvfp4' (attention.py: Q K^T and the dS products on NVFP4 operands, SPEC.md 8.3).
"""

import contextlib
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from attention import attention

# the block linears' recipe: BF16, an FP4 recipe of linear.RECIPES, or 'float8', the FP8 baseline a
# Hopper user would otherwise run (torchao's float8 training, tensorwise scales; pip install torchao)
RECIPES = ('bf16', 'quartet', 'nvfp4', 'quartet2', 'fullstack', 'float8')
# the first and last blocks' linears: 'auto' the recipe's rule (fp4_blocks: BF16 under nvfp4,
# the recipe's own under the others), 'bf16' BF16 under every recipe, 'fp4' the recipe's everywhere
END_BLOCKS = ('auto', 'bf16', 'fp4')
ATTENTIONS = ('bf16', 'nvfp4')  # attention.py's fmt None / 'nvfp4'; combines with any recipe
RECOMPUTES = ('none', 'mlp')    # what the backward recomputes instead of keeping (Block.forward)

# -----------------------------------------------------------------------------
# config and named sizes

@dataclass
class GPTConfig:
    block_size: int = 512
    vocab_size: int = 100352  # cl100k_base's 100277, padded up to a multiple of 128
    n_layer: int = 6
    n_head: int = 5
    n_kv_head: int = 0        # 0: same as n_head (no GQA)
    n_embd: int = 640
    ffn_hidden: int = 0       # 0: 8d/3 rounded up to a multiple of 256 (Quartet's rule)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    lora_rank: int = 0        # fullstack: rank of each block linear's BF16 part (SPEC 8.4);
                              # 0: lora.lora_rank_for's rule (n_embd / 16), -1: none (ablation)
    end_blocks: str = 'auto'  # one of END_BLOCKS: the first and last blocks' recipe (fp4_blocks)
    attention: str = 'bf16'   # one of ATTENTIONS
    loss_chunk: int = 0       # > 0: cross-entropy over the lm_head this many tokens at a time
    recompute: str = 'none'   # one of RECOMPUTES: 'mlp' reruns ln_2 -> gate_up -> SwiGLU in the backward

    def __post_init__(self):
        if self.n_kv_head == 0:
            self.n_kv_head = self.n_head
        if self.ffn_hidden == 0:
            self.ffn_hidden = 256 * math.ceil(8 * self.n_embd / 3 / 256)
        assert self.n_embd % self.n_head == 0, 'n_embd must be divisible by n_head'
        assert self.n_head % self.n_kv_head == 0, 'n_head must be a multiple of n_kv_head'
        assert (self.n_embd // self.n_head) % 2 == 0, 'RoPE needs an even head size'
        if self.end_blocks not in END_BLOCKS:
            raise ValueError(f"unknown end_blocks {self.end_blocks!r}; choose one of {', '.join(END_BLOCKS)}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"unknown attention {self.attention!r}; choose one of {', '.join(ATTENTIONS)}")
        if self.attention == 'nvfp4' and (self.n_embd // self.n_head) % 16:
            raise ValueError(f"attention='nvfp4' needs a head size divisible by 16, got {self.n_embd // self.n_head}")
        if self.recompute not in RECOMPUTES:
            raise ValueError(f"unknown recompute {self.recompute!r}; choose one of {', '.join(RECOMPUTES)}")

# Quartet's shapes (SPEC.md 6): the name is the non-embedding parameter count.
# All have head size 128, so every block linear is a multiple of 128 wide, which the
# FP4 recipes need (Hadamard-128 blocks in quartet2). '1b' counts the embeddings too
# (the 800m shape at seq 2048: 0.82B in the blocks + 0.41B in wte and lm_head).
# 'tiny' is for CPU runs and tests: d 128, SwiGLU hidden 512, still FP4-compatible.
SIZES = {
    'tiny': dict(n_layer=3, n_head=2, n_embd=128, block_size=128),
    # below Quartet's shapes, six blocks like its 30M: the study's law fit wants runs at 5-20
    # tokens a parameter, which for these fit in minutes (the 100K-vocab head is most of a step);
    # 2m (eight blocks of one 128-wide head) reaches 12-48 tokens a parameter at 25M-100M tokens
    '2m':   dict(n_layer=8, n_head=1, n_embd=128),
    '5m':   dict(n_layer=6, n_head=2, n_embd=256),
    '11m':  dict(n_layer=6, n_head=3, n_embd=384),
    '20m':  dict(n_layer=6, n_head=4, n_embd=512),
    '30m':  dict(n_layer=6, n_head=5, n_embd=640),
    '50m':  dict(n_layer=7, n_head=6, n_embd=768),
    '100m': dict(n_layer=8, n_head=8, n_embd=1024),
    '200m': dict(n_layer=10, n_head=10, n_embd=1280),
    '430m': dict(n_layer=13, n_head=13, n_embd=1664),
    '800m': dict(n_layer=16, n_head=16, n_embd=2048),
    '1b':   dict(n_layer=16, n_head=16, n_embd=2048, block_size=2048),
}

def config_for(size, **overrides):
    """GPTConfig for a named size; overrides (e.g. vocab_size, block_size) win."""
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; known: {', '.join(SIZES)}")
    return GPTConfig(**{**SIZES[size], **overrides})

# -----------------------------------------------------------------------------
# layers

class RMSNorm(nn.Module):

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # normalize in fp32: the mean of squares of bf16 activations loses bits
        y = F.rms_norm(x.float(), (x.size(-1),), eps=self.eps)
        return (y * self.weight).type_as(x)

def rope_tables(head_size, block_size, theta):
    """cos and sin of the rotation angles, each (block_size, head_size/2), fp32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)
    angles = torch.outer(torch.arange(block_size, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()

def apply_rope(x, cos, sin):
    """Rotate pairs (x[i], x[i + hs/2]) by position-dependent angles (Llama's 'rotate half')."""
    T = x.size(-2)
    cos, sin = cos[:T].type_as(x), sin[:T].type_as(x)   # (T, hs/2)
    x1, x2 = x.chunk(2, dim=-1)                         # (B, nh, T, hs/2) each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_size = config.n_embd // config.n_head
        self.fmt = None if config.attention == 'bf16' else config.attention
        # q, k and v in one fused linear: one bigger GEMM instead of three
        qkv_out = (self.n_head + 2 * self.n_kv_head) * self.head_size
        self.qkv = nn.Linear(config.n_embd, qkv_out, bias=False)
        self.o = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x, cos, sin, cache=None):
        B, T, C = x.size()
        hs, nh, nkv = self.head_size, self.n_head, self.n_kv_head
        q, k, v = self.qkv(x).split([nh * hs, nkv * hs, nkv * hs], dim=-1)
        q = q.view(B, T, nh, hs).transpose(1, 2)   # (B, nh, T, hs)
        k = k.view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        # v copied out of qkv's output: attention saves v for its backward, and a view would keep
        # the whole (B, T, qkv_out) output alive with it (q and k are new tensors after RoPE)
        v = v.contiguous().view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # generating: attend to the cached positions too. SDPA in BF16:
            k, v = cache.update(self, k, v)  # (B, nkv, S, hs), S = cached + T; FP4 attention
            mask = causal_mask(T, k.size(2), x.device)  # quantizes whole sequences (docs/fullstack.md, FP4 attention)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=nkv != nh)
        else:  # SDPA (flash/cuDNN) or FP4 attention; each kv head serves nh/nkv q heads (GQA)
            y = attention(q, k, v, causal=True, fmt=self.fmt)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.o(y)

class SwiGLU(nn.Module):
    """silu(gate) * up of the fused gate_up output; a module (like nanoGPT's nn.GELU) so that
    module hooks see it (bench.py counts what each kind of layer saves for the backward)."""

    def forward(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)  # (B, T, ffn_hidden) each
        return F.silu(gate) * up

class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        # gate and up projections fused into one linear (one GEMM), split after
        self.gate_up = nn.Linear(config.n_embd, 2 * config.ffn_hidden, bias=False)
        self.swiglu = SwiGLU()
        self.down = nn.Linear(config.ffn_hidden, config.n_embd, bias=False)

    def hidden(self, x):
        return self.swiglu(self.gate_up(x))  # (B, T, ffn_hidden)

    def forward(self, x):
        return self.down(self.hidden(x))

class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = MLP(config)
        self.recompute_mlp = config.recompute == 'mlp'

    def forward(self, x, cos, sin, cache=None):
        x = x + self.attn(self.ln_1(x), cos, sin, cache)
        if self.recompute_mlp and torch.is_grad_enabled():
            # keep only x: the backward reruns ln_2 -> gate_up -> SwiGLU (docs/speed.md: memory):
            # gate_up's (B, T, 2 ffn_hidden) output and ln_2's and gate_up's saved tensors are
            # not held from the forward to the backward. Same numbers: the forward draws no
            # random numbers, and checkpoint restores the RNG state around the rerun anyway
            h = checkpoint(lambda x: self.mlp.hidden(self.ln_2(x)), x, use_reentrant=False)
            return x + self.mlp.down(h)
        x = x + self.mlp(self.ln_2(x))
        return x

# -----------------------------------------------------------------------------
# the model

class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=RMSNorm(config.n_embd, config.norm_eps),
        ))
        # untied: Quartet's Llama-2-style models keep a separate output matrix
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # RoPE tables are derived, not learned: keep them out of the state_dict
        cos, sin = rope_tables(config.n_embd // config.n_head, config.block_size, config.rope_theta)
        self.register_buffer('rope_cos', cos, persistent=False)
        self.register_buffer('rope_sin', sin, persistent=False)
        self.apply(self._init_weights)
        # GPT-2's scaled init for the projections that write into the residual stream
        for name, p in self.named_parameters():
            if name.endswith(('attn.o.weight', 'mlp.down.weight')):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if getattr(module, 'bias', None) is not None:
                torch.nn.init.zeros_(module.bias)

    def get_num_params(self, non_embedding=True):
        """Parameter count; non_embedding drops wte and lm_head (how Quartet names sizes)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wte.weight.numel() + self.lm_head.weight.numel()
        return n

    def forward(self, idx, targets=None, cache=None):
        B, T = idx.size()
        pos = cache.pos if cache is not None else 0  # idx's first position
        assert pos + T <= self.config.block_size, f'sequence of {pos + T} > block_size {self.config.block_size}'
        cos, sin = self.rope_cos[pos:pos + T], self.rope_sin[pos:pos + T]  # (T, hs/2)
        x = self.transformer.wte(idx)  # (B, T, C)
        for block in self.transformer.h:
            x = block(x, cos, sin, cache)
        if cache is not None:
            cache.pos += T
        x = self.transformer.ln_f(x)
        if targets is None:
            # inference: only the last position's logits are needed
            return self.lm_head(x[:, [-1], :]), None
        if self.config.loss_chunk:  # the (B, T, vocab_size) logits are never whole: no logits returned
            loss = chunked_cross_entropy(x.view(-1, x.size(-1)), self.lm_head.weight, targets.reshape(-1),
                                         self.config.loss_chunk)
            return None, loss
        logits = self.lm_head(x)  # (B, T, vocab_size)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1),
                               ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        # decay matrices (linears, embeddings); not norms, biases or other 1-d params. train.py
        # builds its optimizers through muon.build (adamw, adamw_fp4, muon, root, root_fp4)
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {'params': [p for p in params if p.dim() >= 2], 'weight_decay': weight_decay},
            {'params': [p for p in params if p.dim() < 2], 'weight_decay': 0.0},
        ]
        # fused: one kernel for all params, on CUDA and CPU (6x faster than foreach on CPU)
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=True)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, kv_cache=True, n_vocab=None):
        """Sample max_new_tokens after idx (B, T); temperature 0 picks the most likely token.
        n_vocab: sample only ids below it, the tokenizer's (the model's vocab_size is padded to a
        multiple of 128; an undertrained model can put mass on the ids past the tokenizer's).
        With kv_cache each step runs only the newest position against the cached keys and
        values. Past block_size the window slides, which moves every position's RoPE angle,
        so from then on each step recomputes the window, as nanoGPT does without a cache. Both
        paths compute the same function; their rounding differs (see sample.py for what that
        does to FP4 layers)."""
        cache = None
        with fp4_rows_padded(self):
            for _ in range(max_new_tokens):
                if not kv_cache or idx.size(1) > self.config.block_size:
                    logits, _ = self(idx[:, -self.config.block_size:])
                elif cache is None:
                    cache = KVCache()
                    logits, _ = self(idx, cache=cache)
                else:
                    logits, _ = self(idx[:, -1:], cache=cache)
                idx = torch.cat((idx, next_token(logits[:, -1, :n_vocab], temperature, top_k)), dim=1)
        return idx

# -----------------------------------------------------------------------------
# generation helpers: KV cache, sampling, FP4 token counts

class KVCache:
    """The keys and values of the positions run so far, per attention layer, and how many."""

    def __init__(self):
        self.kv, self.pos = {}, 0

    def update(self, layer, k, v):
        """Append this step's k, v (B, nkv, T, hs) to the layer's; return all of them."""
        if layer in self.kv:
            k0, v0 = self.kv[layer]
            k, v = torch.cat((k0, k), dim=2), torch.cat((v0, v), dim=2)
        self.kv[layer] = (k, v)
        return k, v

def causal_mask(T, S, device):
    """(T, S) bool: the T newest of S positions each see themselves and everything before."""
    return torch.ones(T, S, dtype=torch.bool, device=device).tril(S - T)

def next_token(logits, temperature, top_k):
    """(B, vocab_size) logits -> (B, 1) token ids: greedy at temperature 0, else sampled."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits[logits < v[:, [-1]]] = -float('inf')
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)

@contextlib.contextmanager
def fp4_rows_padded(model):
    """Let FP4Linear run on any number of tokens while generating. It asks for a token count
    divisible by its recipe's block (linear._dim_multiple: 32 or 128), which training's backward
    needs (the weight gradient's GEMM runs over tokens, SPEC 5); a sampling step has one token
    a sequence. The forward quantizes each row on its own, in blocks along the input dim, and
    NVFP4's tensor scale is an absmax, which rows of zeros leave alone. So padding the rows
    with zeros up to the multiple leaves the real rows' outputs as they were; they are sliced
    back out after the layer."""
    linear = sys.modules.get('linear')  # not imported: no FP4 layers in any model
    layers = [m for m in model.modules() if linear is not None and isinstance(m, linear.FP4Linear)]
    handles = [h for m in layers for h in (m.register_forward_pre_hook(_pad_rows),
                                           m.register_forward_hook(_unpad_rows))]
    try:
        yield model
    finally:
        for h in handles:
            h.remove()

def _pad_rows(layer, args):
    x, = args                                # (..., in_features)
    rows, mult = x.numel() // x.size(-1), sys.modules['linear']._dim_multiple(layer.recipe)
    layer._padded_from = (x.shape, -rows % mult)
    return (F.pad(x.reshape(rows, x.size(-1)), (0, 0, 0, -rows % mult)),)  # (rows + pad, in)

def _unpad_rows(layer, args, y):
    shape, pad = layer._padded_from          # y: (rows + pad, out_features)
    return y[:y.size(0) - pad].view(*shape[:-1], y.size(-1))
# cross-entropy over the lm_head in chunks of tokens

class ChunkedLMHeadLoss(torch.autograd.Function):
    """Mean cross-entropy of the logits x W^T against targets (ignore_index -1), `chunk` rows of x
    at a time: the forward keeps only the loss, the backward recomputes each chunk's logits. The
    numerics of lm_head + F.cross_entropy(logits.float()): logits in the autocast dtype (BF16), the
    softmax in FP32, the logits' gradient rounded to the logits' dtype, dW summed in FP32."""

    @staticmethod
    def forward(ctx, x, w, targets, chunk, dt):  # x (N, C), w (V, C), targets (N,); dt: the logits' dtype
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        for s in range(0, x.size(0), chunk):
            logits, t, valid = _chunk_logits(x, w, targets, s, chunk, dt)  # (n, V) FP32
            picked = logits.gather(1, t.unsqueeze(1)).squeeze(1)
            total = total + ((torch.logsumexp(logits, -1) - picked) * valid).sum()
        count = (targets != -1).sum()
        ctx.save_for_backward(x, w, targets, count)
        ctx.chunk, ctx.dt = chunk, dt
        return total / count

    @staticmethod
    def backward(ctx, grad):
        x, w, targets, count = ctx.saved_tensors
        dx, dw = torch.empty_like(x), torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        wd = w.to(ctx.dt)
        scale = grad / count
        for s in range(0, x.size(0), ctx.chunk):
            logits, t, valid = _chunk_logits(x, w, targets, s, ctx.chunk, ctx.dt)
            d = torch.softmax(logits, -1)  # d loss / d logits = (softmax - onehot) / count
            d[torch.arange(d.size(0), device=d.device), t] -= 1
            d = (d * (valid * scale).unsqueeze(1)).to(ctx.dt)
            dx[s:s + ctx.chunk] = (d @ wd).to(x.dtype)
            dw += (d.t() @ x[s:s + ctx.chunk].to(ctx.dt)).float()
        return dx, dw.to(w.dtype), None, None, None

def _chunk_logits(x, w, targets, s, chunk, dt):
    """FP32 logits of rows s .. s + chunk (computed in dt, as autocast's lm_head), their targets
    (ignored ones as 0) and the valid mask."""
    t = targets[s:s + chunk]
    logits = (x[s:s + chunk].to(dt) @ w.to(dt).t()).float()
    return logits, t.clamp(min=0), (t != -1).float()

def chunked_cross_entropy(x, w, targets, chunk):
    """F.cross_entropy(x @ w.T, targets, ignore_index=-1) without the whole (N, V) logits."""
    dev = x.device.type
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else torch.promote_types(x.dtype, w.dtype)
    with torch.autocast(dev, enabled=False):  # the Function casts as autocast would
        return ChunkedLMHeadLoss.apply(x, w, targets, chunk, dt)

# -----------------------------------------------------------------------------
# FP4 recipes

def fp4_blocks(n_layer, recipe, end_blocks='auto'):
    """Indices of the blocks whose linears run in FP4 under a recipe (in FP8 under float8).
    nvfp4 keeps the first and last blocks in BF16 (NVIDIA's recipe, SPEC.md 5: ~15% of
    the linears stay high precision; training everything in FP4 diverged at 12B); end_blocks
    'bf16' or 'fp4' sets that for any recipe (to compare recipes at the same coverage)."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
    if end_blocks not in END_BLOCKS:
        raise ValueError(f"unknown end_blocks {end_blocks!r}; choose one of {', '.join(END_BLOCKS)}")
    if recipe == 'bf16':
        return []
    if end_blocks == 'bf16' or (end_blocks == 'auto' and recipe == 'nvfp4'):
        return [i for i in range(n_layer) if i not in (0, n_layer - 1)]
    return list(range(n_layer))

def gemm_multiple(recipe):
    """What every block linear's in and out features, and a micro-step's token count, must be
    divisible by: an FP4 recipe's block or rotation (linear._dim_multiple: 32 or 128), float8's 16
    (torch._scaled_mm's alignment; the weight gradient contracts over the tokens), else 1."""
    if recipe == 'float8':
        return 16
    if recipe not in RECIPES or recipe == 'bf16':
        return 1
    import linear
    return linear._dim_multiple(recipe)

def shape_problem(size, n_kv_head, recipe, batch_size, block_size):
    """What the recipe's FP4 (or FP8) GEMMs cannot divide, as one line, or None: every block
    linear's in and out features, and the tokens of a micro-step (batch_size * block_size), over
    which the weight gradient's GEMM runs. Checked before training rather than in the first forward."""
    try:
        cfg = config_for(size, block_size=block_size, n_kv_head=n_kv_head)
    except (AssertionError, ValueError) as e:
        return f'model_size={size!r} with n_kv_head={n_kv_head}: {e}'
    mult = gemm_multiple(recipe)
    tokens = batch_size * block_size
    if tokens % mult:
        step = mult // math.gcd(batch_size, mult)  # block_size must be a multiple of this
        fits = [b for b in (block_size // step * step, (block_size // step + 1) * step) if b]
        return (f'recipe {recipe!r} needs batch_size * block_size divisible by {mult} (its low-precision GEMMs '
                f'run over the tokens of a micro-step), got {batch_size} * {block_size} = {tokens}: '
                f"use e.g. --block_size={' or '.join(map(str, fits))}, or another batch_size")
    hs = cfg.n_embd // cfg.n_head
    dims = dict(n_embd=cfg.n_embd, ffn_hidden=cfg.ffn_hidden, qkv_width=(cfg.n_head + 2 * cfg.n_kv_head) * hs)
    bad = {k: v for k, v in dims.items() if v % mult}
    if bad:
        return (f'recipe {recipe!r} needs every block linear dim divisible by {mult}; model_size={size!r}, '
                f'n_kv_head={n_kv_head} give {bad}: choose another n_kv_head or model_size')
    return None


def to_float8(model, scaling='tensorwise', blocks=None):
    """The block linears (or all of `blocks`' linears) as torchao Float8Linear, in place, with
    torchao's `scaling` recipe ('tensorwise', 'rowwise'): FP8 GEMMs in all three products, the
    same Parameters and state_dict keys. bench.py's float8 rows and recipe 'float8' are this."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        raise ImportError(f"recipe 'float8' is torchao's float8 training: pip install torchao ({err})") from err
    config = Float8LinearConfig.from_recipe_name(scaling)
    for block in (model.transformer.h if blocks is None else blocks):
        convert_to_float8_training(block, config=config)
    return model

def apply_recipe(model, recipe):
    """Swap the block linears (qkv, o, gate_up, down) for linear.FP4Linear, in place, or for
    torchao's Float8Linear under 'float8' (to_float8). Embeddings and lm_head are never touched.
    'bf16' leaves plain nn.Linear (autocast runs them in BF16), so the model works without linear.py."""
    blocks = fp4_blocks(model.config.n_layer, recipe, model.config.end_blocks)
    if recipe == 'float8':
        return to_float8(model, blocks=[model.transformer.h[i] for i in blocks])
    if blocks:
        import linear  # only the FP4 recipes need it
        # fullstack: L = 0 until linear.refit_lora(model) (train.py refits at step 0)
        lora = {'lora_rank': model.config.lora_rank} if recipe == 'fullstack' else {}
        for i in blocks:
            linear.to_fp4(model.transformer.h[i], recipe, **lora)
    return model

# -----------------------------------------------------------------------------
# the precision schedule: FP4 for most of the run, BF16 at the end (train.py's fp4_until)
# NVIDIA's NVFP4 recipe switches the GEMMs to BF16 for the last part of training, which closes most of
# the remaining loss gap (SPEC.md 5, nvfp4). One step switches all three GEMMs of every FP4 block linear.

def fp4_switch_step(fp4_until, max_iters):
    """The first step whose block linears run BF16: s = round(fp4_until * max_iters) (Python's
    round, halves to even). Steps 0 .. s-1 run the recipe's FP4 GEMMs, s .. max_iters-1 BF16;
    fp4_until = 1 gives s = max_iters: FP4 to the end."""
    return round(fp4_until * max_iters)

def schedule_problem(fp4_until, max_iters, recipe, cuda_graph=False):
    """Why fp4_until cannot apply to this run, as one line, or None (fp4_until = 1 always applies)."""
    if fp4_until >= 1:
        return None
    s = fp4_switch_step(fp4_until, max_iters)
    why = (f'recipe {recipe!r} runs no FP4 GEMMs to switch' if recipe in ('bf16', 'float8') else
           'cuda_graph=True replays graphs captured with the FP4 kernels' if cuda_graph else
           f'it leaves no {"FP4" if s == 0 else "BF16"} step' if s in (0, max_iters) else None)
    return why and (f'fp4_until={fp4_until} (FP4 GEMMs before step round(fp4_until * max_iters) = '
                    f'round({fp4_until} * {max_iters}) = {s}, BF16 from it) cannot apply: {why}')

def to_bf16_gemms(model):
    """Run every FP4 linear of model in BF16 from its next forward, in place, and return how many.
    An FP4Linear whose recipe attribute is 'bf16' runs F.linear (BF16 under autocast): forward,
    input gradient and weight gradient leave FP4 together. The Parameters, and so the optimizer and
    its states, stay as they are. Under torch.compile the changed attribute fails one guard: one
    recompile at the switch, then the BF16 graph is reused (test_schedule.py checks both)."""
    layers = [m for m in model.modules() if isinstance(m, nn.Linear) and isinstance(getattr(m, 'recipe', None), str)]
    for m in layers:  # FP4Linear (by its recipe attribute: wherever the class lives)
        m.recipe = 'bf16'
    return len(layers)

# -----------------------------------------------------------------------------
# CUDA graphs: the training forward and backward replayed without the host's launch work

class LossOf(nn.Module):
    """model(x, y)'s loss alone, as a module: make_graphed_callables finds the parameters through it."""
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        return self.model(x, y)[1]


class Graphed(nn.Module):
    """graphed()'s result: model's parameters (for clipping) and a forward that replays the graphs."""
    def __init__(self, model, fn):
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self, x, y):
        return None, self.fn(x, y)


def graphed(model, x, y, ctx):
    """model's training forward and backward captured as two CUDA graphs (torch.cuda.
    make_graphed_callables) on the sample batch (x, y) and replayed each micro-step: the FP4 layers
    run eagerly between a compiled graph's pieces, at ~2 ms of host time a layer (docs/speed.md).
    A model-like callable (x, y) -> (None, loss): every replay copies its x, y into the graph's
    inputs and writes the same output tensor, so the loss is read before the next micro-step. The
    three warmup runs take autograd.grad, not backward: they leave the parameters' .grad alone, but
    draw random numbers. The stochastic-rounding seeds are drawn on the GPU, so each replay rounds
    afresh. Clipping, the finite check and the optimizer step stay eager, after the graphs."""
    with ctx:
        # allow_unused_input: a parameter the loss does not reach gets no gradient rather than an error
        fn = torch.cuda.make_graphed_callables(LossOf(model), (x, y), num_warmup_iters=3, allow_unused_input=True)
    # The backward graph hands out the same gradient buffers each replay. Into a .grad that is None,
    # autograd may store such a buffer itself, which the next micro-step's replay then overwrites:
    # with accumulation, the step would get twice the last micro-step's gradient (measured on the
    # H200). A .grad that exists is added to in place, so the gradients stay allocated (the caller
    # zeroes them instead of freeing them; a parameter the loss does not reach gets zeros, not None).
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    return Graphed(model, fn)
