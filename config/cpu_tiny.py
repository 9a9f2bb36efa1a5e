# What `python train.py` does on a CPU, spelled out (the defaults there already are this):
# the tiny model on the Python-source corpus, ~3 minutes on 2 cores including data prep.
# $ python train.py config/cpu_tiny.py --recipe=bf16
model_size = 'tiny'
dataset = 'pycode'
block_size = 64
batch_size = 4
gradient_accumulation_steps = 1
max_iters = 90
learning_rate = 4e-3
eval_interval = 30
eval_iters = 2
device = 'cpu'
dtype = 'float32'
compile = False
