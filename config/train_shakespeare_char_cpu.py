# A Shakespeare character model on a laptop CPU in a few minutes (2 cores).
# python train.py config/train_shakespeare_char_cpu.py
out_dir = "out-shakespeare-char-cpu"
dataset = "shakespeare_char"
eval_interval = 250
eval_iters = 20
log_interval = 50

block_size = 128
batch_size = 32
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0

learning_rate = 2e-3
max_iters = 2000
lr_decay_iters = 2000
min_lr = 2e-4
warmup_iters = 100
beta2 = 0.99
