# CPU speedrun: the lowest Shakespeare-character val loss we reach in 10 minutes of wall time on 2 cores.
# python data/shakespeare_char/prepare.py && python train.py config/speedrun_shakespeare_char_cpu.py
# What got it there (docs/research_log.md): a small 4 x 128 model that takes many steps (batch 16),
# Muon for the blocks' matrices at a high rate, RoPE + RMSNorm + ReLU², no dropout, bf16 autocast.
out_dir = "out-speedrun-char-cpu"
dataset = "shakespeare_char"
eval_interval = 200
eval_iters = 20
log_interval = 100

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
max_iters = 4000
beta2 = 0.99
