# A vision transformer on scikit-learn's 8x8 digits (python data/images/prepare.py digits), on a laptop CPU.
# The chapter's ViT: 4x4 patches through a strided convolution (4 tokens), a class token, learned
# positions, pre-norm blocks, a classifier on the class token's final state. 1,437 training images are
# little data for a ViT: each drawn image is shifted by up to a pixel (image_shift), which halves the
# held-out loss; 4x4 patches beat 2x2 ones here (docs/ablations.md, study 14).
out_dir = "out-vit-digits"
dataset = "digits"
family = "encoder"
head = "classify"
n_classes = 10
image_size = 8
patch_size = 4
channels = 1
block_size = 5  # 4 patches and the class token
n_layer = 4
n_head = 4
n_embd = 64
mlp = "gelu_exact"
dropout = 0.1
image_shift = 1

batch_size = 64
max_iters = 8000
eval_interval = 1000
eval_iters = 10  # 640 examples: the whole val split (360), in order
log_interval = 500
learning_rate = 2e-3
min_lr = 1e-4
warmup_iters = 100
weight_decay = 0.05
beta2 = 0.99
device = "cpu"
dtype = "float32"
