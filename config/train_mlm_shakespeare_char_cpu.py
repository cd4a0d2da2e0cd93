# An encoder in BERT's shape trained with BERT's objective on Tiny Shakespeare's characters
# (python data/shakespeare_char/prepare.py): 15% of the characters chosen, 80% of those replaced by [MASK],
# 10% by a random character, 10% kept, and the loss on the chosen ones only. Post-norm blocks, an
# embedding LayerNorm, the erf GELU, the masked-token head (dense, GELU, LayerNorm, tied decoder with a
# bias): export.py writes it as a BertForMaskedLM. Every position sees every other (family=encoder).
# config/finetune_authors_cpu.py fine-tunes it into a classifier.
out_dir = "out-mlm-shakespeare"
dataset = "shakespeare_char"
family = "encoder"
head = "mlm"
norm_placement = "post"
emb_norm = True
mlp = "gelu_exact"
block_size = 64  # [CLS] and 63 characters
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.1

batch_size = 32
max_iters = 2000
eval_interval = 500
eval_iters = 10
log_interval = 100
learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 200  # post-norm blocks need a warmup (Xiong et al. 2020)
beta2 = 0.99
device = "cpu"
dtype = "float32"
