# A Shakespeare character model on a laptop CPU in about three minutes (2 cores); the Quick start uses it.
# python data/shakespeare_char/prepare.py && python train.py config/train_shakespeare_char_cpu.py
# The speedrun's recipe (config/speedrun_shakespeare_char_cpu.py) on a shorter schedule.
out_dir = "out-shakespeare-char-cpu"
dataset = "shakespeare_char"
eval_interval = 250
eval_iters = 20
log_interval = 50

block_size = 128
batch_size = 16
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
pos_emb = "rope"
norm = "rmsnorm"
mlp = "relu2"
bias = False

optimizer = "muon"
learning_rate = 1e-2
min_lr = 1e-3
warmup_iters = 20
max_iters = 1500
beta2 = 0.99
