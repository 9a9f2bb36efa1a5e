# Full-Stack FP4 (SPEC.md 8) on Quartet's 30M model, the same run as config/quartet_30m.py:
# 3B tokens of FineWeb-Edu, 256K tokens a step (512 x 512), ~11.4K steps.
# $ torchrun --standalone --nproc_per_node=8 train.py config/fullstack_30m.py
model_size = '30m'
recipe = 'fullstack'      # every block linear: NVFP4 four-over-six + a BF16 LoRA-SVD part (8.4)
lora_rank = 0             # 0: lora.lora_rank_for's rule (48 at d 640); -1: no low-rank part
lora_refit_interval = 4000  # and at steps 50, 100, 200, ... before it (train.py's lora_refit_first)
end_blocks = 'bf16'       # first and last blocks BF16, as nvfp4 does: at 30M, 13M tokens, 0.58%
                          # [0.24%, 0.93%] closer to BF16 than all six in FP4 (docs/accuracy.md)
attention = 'nvfp4'       # Q, K, V quantized once; Q K^T and the dS products in NVFP4 (8.3)
optimizer = 'root_fp4'    # ROOT with NVFP4 Newton-Schulz (BF16 momentum) on the 2-D hidden
                          # weights (8.2); AdamW with FP4 states (8.1) on the rest (muon.build)
dataset = 'fineweb'
out_dir = 'out/30m-fullstack'
block_size = 512
batch_size = 64
gradient_accumulation_steps = 8  # split across the DDP ranks
max_iters = 11_500
learning_rate = 1.5e-3
eval_interval = 500
eval_iters = 40
