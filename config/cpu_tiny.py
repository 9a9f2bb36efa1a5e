# What `python train.py` does on a CPU, spelled out (the defaults there already are this):
# the tiny model on the default corpus, 160 steps of 8 x 64 tokens (docs/training.md: time and loss).
# $ python train.py config/cpu_tiny.py --recipe=bf16
model_size = 'tiny'
dataset = 'pycode'
block_size = 64
batch_size = 8
gradient_accumulation_steps = 1
max_iters = 160
learning_rate = 1e-2
eval_interval = 40
eval_iters = 2
device = 'cpu'
dtype = 'float32'
compile = False
