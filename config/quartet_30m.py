# Quartet's 30M model (6 layers, d 640, 5 heads; SPEC.md 6) at 100 tokens per parameter:
# 3B tokens of FineWeb-Edu, 256K tokens a step (512 x 512), ~11.4K steps.
# $ python data/fineweb/prepare.py --max_tokens=3.2e9
# $ torchrun --standalone --nproc_per_node=8 train.py config/quartet_30m.py --recipe=quartet
# Each recipe (bf16, quartet, nvfp4, quartet2) to its own out_dir to compare them.
model_size = '30m'
recipe = 'quartet'
dataset = 'fineweb'
out_dir = 'out/30m'
block_size = 512
batch_size = 64
gradient_accumulation_steps = 8  # split across the DDP ranks
max_iters = 11_500
learning_rate = 1.5e-3
eval_interval = 500
eval_iters = 40
