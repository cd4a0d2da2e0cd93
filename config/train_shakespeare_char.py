# nanoGPT's "baby GPT" on Shakespeare characters: a GPU config (a few minutes on one A100-class GPU).
# python data/shakespeare_char/prepare.py && python train.py config/train_shakespeare_char.py
out_dir = "out-shakespeare-char"
dataset = "shakespeare_char"
eval_interval = 250  # it overfits: evaluate often
eval_iters = 200
log_interval = 10
always_save_checkpoint = False  # keep the best validation checkpoint only

gradient_accumulation_steps = 1
batch_size = 64
block_size = 256  # characters of context

n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2

learning_rate = 1e-3  # a small model can take a larger rate
max_iters = 5000
lr_decay_iters = 5000
min_lr = 1e-4  # learning_rate / 10
beta2 = 0.99  # a little larger: few tokens per step
warmup_iters = 100
