# Causal linear attention (Katharopoulos et al. 2020) against softmax attention, alone and as a hybrid
# with one softmax layer on top (RRRL), at the shape and budget of the windows study.
# python ablate.py config/ablations/linear.py
title = "Linear attention vs softmax (Shakespeare characters, 4 x 128, block 256, 3.3M tokens)"
base = dict(
    dataset="shakespeare_char", n_layer=4, n_head=4, n_embd=128, block_size=256, batch_size=16,
    max_iters=800, warmup_iters=50, learning_rate=2e-3, min_lr=2e-4, beta2=0.99, dropout=0.0,
    pos_emb="rope", norm="rmsnorm", mlp="relu2", bias=False, eval_interval=100, eval_iters=20, log_interval=100,
)
variants = {
    "softmax (L)": dict(attn_pattern="L"),
    "linear (R)": dict(attn_pattern="R"),
    "hybrid (RRRL)": dict(attn_pattern="RRRL"),
}
seeds = [1, 2]
quick = dict(max_iters=200, batch_size=8, eval_interval=50, eval_iters=10, seeds=1)  # ablate.py --quick=True: ~1.5 min
