# The baby GPT with the modern stack: RoPE, RMSNorm, SwiGLU, QK-norm, z-loss, no biases.
# python train.py config/train_shakespeare_char_modern.py   (a GPU config, like train_shakespeare_char.py)
out_dir = "out-shakespeare-char-modern"
dataset = "shakespeare_char"
eval_interval = 250
eval_iters = 200
log_interval = 10
always_save_checkpoint = False

batch_size = 64
block_size = 256

n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2
pos_emb = "rope"
norm = "rmsnorm"
mlp = "swiglu"  # hidden 1024 = 8/3 * 384 rounded up to 64: about the 4x GELU MLP's parameters
qk_norm = True
z_loss = 1e-4
bias = False

learning_rate = 1e-3
max_iters = 5000
lr_decay_iters = 5000
min_lr = 1e-4
beta2 = 0.99
warmup_iters = 100
