# The draft for config/spec_target_shakespeare_char_cpu.py: one layer of 128 on the same characters (the
# same vocabulary, which a draft needs), under a minute on 2 cores.
out_dir = "out-spec-draft"
dataset = "shakespeare_char"
eval_interval = 500
eval_iters = 20
log_interval = 250

block_size = 256
batch_size = 16
n_layer = 1
n_head = 4
n_embd = 128
dropout = 0.0

learning_rate = 3e-3
min_lr = 3e-4
warmup_iters = 50
max_iters = 1000
