# Xiong et al. (2020): post-norm blocks (the 2017 transformer) need learning-rate warmup; pre-norm blocks do
# not. Pre vs post, each without warmup and with 10% of the steps, at two learning rates. 6 layers: the
# post-norm gradient problem grows with depth.
# python ablate.py config/ablations/norm_placement.py
title = "Norm placement and warmup (Shakespeare characters, 6 x 128, block 128, 1.6M tokens)"
base = dict(
    dataset="shakespeare_char", n_layer=6, n_head=4, n_embd=128, block_size=128, batch_size=16,
    max_iters=800, learning_rate=1e-3, min_lr=1e-4, beta2=0.99, dropout=0.0,
    pos_emb="rope", norm="layernorm", mlp="gelu", bias=False, eval_interval=100, eval_iters=20, log_interval=100,
)
variants = {
    "pre, lr 1e-3, no warmup": dict(norm_placement="pre", warmup_iters=0),
    "pre, lr 1e-3, warmup 80": dict(norm_placement="pre", warmup_iters=80),
    "post, lr 1e-3, no warmup": dict(norm_placement="post", warmup_iters=0),
    "post, lr 1e-3, warmup 80": dict(norm_placement="post", warmup_iters=80),
    "pre, lr 1e-2, no warmup": dict(norm_placement="pre", warmup_iters=0, learning_rate=1e-2, min_lr=1e-3),
    "pre, lr 1e-2, warmup 80": dict(norm_placement="pre", warmup_iters=80, learning_rate=1e-2, min_lr=1e-3),
    "post, lr 1e-2, no warmup": dict(norm_placement="post", warmup_iters=0, learning_rate=1e-2, min_lr=1e-3),
    "post, lr 1e-2, warmup 80": dict(norm_placement="post", warmup_iters=80, learning_rate=1e-2, min_lr=1e-3),
}
seeds = [1]
quick = dict(max_iters=100, batch_size=8, eval_interval=50, eval_iters=10)  # ablate.py --quick=True: ~1.5 min
