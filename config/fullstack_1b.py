# Full-Stack FP4 (SPEC.md 8) on the ~1B model, the same run as config/llama_1b.py: seq 2048,
# 1M tokens a step (32 x 16 x 2048), 20B tokens in ~19K steps.
# $ torchrun --standalone --nproc_per_node=8 train.py config/fullstack_1b.py
model_size = '1b'
recipe = 'fullstack'      # every block linear: NVFP4 four-over-six + a BF16 LoRA-SVD part (8.4)
lora_rank = 0             # 0: lora.lora_rank_for's rule (128 at d 2048); -1: no low-rank part
lora_refit_interval = 4000  # and at steps 50, 100, 200, ... before it (train.py's lora_refit_first)
# end_blocks 'auto': all 16 blocks FP4, as bench.py measured fullstack's memory (0.444x BF16's);
# --end_blocks=bf16 (as config/fullstack_30m.py) was 0.58% closer to BF16 at 30M, not run at 1B
attention = 'nvfp4'       # Q, K, V quantized once; Q K^T and the dS products in NVFP4 (8.3)
optimizer = 'root_fp4'    # ROOT with NVFP4 Newton-Schulz (BF16 momentum) on the 2-D hidden
                          # weights (8.2); AdamW with FP4 states (8.1) on the rest (muon.build)
loss_chunk = 4096         # memory, not numerics: the lm_head loss 4K tokens at a time (no whole logits)
recompute = 'mlp'         # and gate_up + SwiGLU rerun in the backward (model.py; docs/speed.md: memory)
dataset = 'fineweb'
out_dir = 'out/1b-fullstack'
block_size = 2048
batch_size = 16
gradient_accumulation_steps = 32
max_iters = 19_000
learning_rate = 6e-4
eval_interval = 1000
eval_iters = 20
