# An encoder-decoder in T5's shape (v1.1: gated GELU, untied head; RMS norm, no biases, relative position
# buckets shared by each stack's layers) learns to spell numbers out: "40213" -> "forty thousand two
# hundred thirteen" (python data/numbers/prepare.py). The encoder reads the digits both ways; each decoder
# block cross-attends to the encoder's final states. Held-out exact match: python eval.py --out_dir=out-seq2seq
out_dir = "out-seq2seq"
dataset = "numbers"
family = "encoder-decoder"
n_encoder_layer = 2
n_layer = 2
n_head = 4
n_embd = 128
block_size = 64
pos_emb = "t5"
norm = "rmsnorm"
norm_eps = 1e-6
bias = False
mlp = "geglu"
tie_embeddings = False
dropout = 0.0

batch_size = 64
max_iters = 1000
eval_interval = 500
eval_iters = 8  # 512 examples: the whole val split (500), in order
log_interval = 100
learning_rate = 3e-3
min_lr = 3e-4
warmup_iters = 100
weight_decay = 0.0
beta2 = 0.99
device = "cpu"
dtype = "float32"
