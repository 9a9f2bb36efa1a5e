# Quartet's 200M model (10 layers, d 1280, 10 heads), 100 tokens per parameter: 20B tokens,
# 512K tokens a step (1024 x 512), ~38K steps. Quartet C4 val loss: 2.814 (quartet) vs
# 2.736 (bf16), SPEC.md 6; ours runs on FineWeb-Edu with cl100k, so compare gaps, not losses.
# $ torchrun --standalone --nproc_per_node=8 train.py config/quartet_200m.py
model_size = '200m'
recipe = 'quartet'
dataset = 'fineweb'
out_dir = 'out/200m'
block_size = 512
batch_size = 64
gradient_accumulation_steps = 16
max_iters = 38_000
learning_rate = 1e-3
eval_interval = 1000
eval_iters = 40
