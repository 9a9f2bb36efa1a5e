# The ~1B model (16 layers, d 2048, 16 heads: 0.82B in the blocks + 0.41B embeddings and
# lm_head) at seq 2048; 1M tokens a step (32 x 16 x 2048). 20B tokens: ~19K steps.
# $ torchrun --standalone --nproc_per_node=8 train.py config/llama_1b.py --recipe=nvfp4
model_size = '1b'
recipe = 'quartet'
dataset = 'fineweb'
out_dir = 'out/1b'
block_size = 2048
batch_size = 16
gradient_accumulation_steps = 32
max_iters = 19_000
learning_rate = 6e-4
eval_interval = 1000
eval_iters = 20
