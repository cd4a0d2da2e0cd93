# Haviv et al. (2022): causal language models without any position encoding do nearly as well.
# python ablate.py config/ablations/positions.py
title = "Position schemes (Shakespeare characters, 4 x 128, 3.3M tokens)"
base = dict(
    dataset="shakespeare_char", n_layer=4, n_head=4, n_embd=128, block_size=128, batch_size=32,
    max_iters=800, warmup_iters=50, learning_rate=2e-3, min_lr=2e-4, beta2=0.99, dropout=0.0,
    norm="rmsnorm", mlp="relu2", bias=False, eval_interval=100, eval_iters=20, log_interval=100,
)
variants = {
    "learned": dict(pos_emb="learned"),
    "sinusoidal": dict(pos_emb="sinusoidal"),
    "rope": dict(pos_emb="rope"),
    "alibi": dict(pos_emb="alibi"),
    "t5": dict(pos_emb="t5"),
    "none (NoPE)": dict(pos_emb="none"),
}
seeds = [1, 2]
quick = dict(max_iters=150, batch_size=16, eval_interval=50, eval_iters=10, seeds=1)  # ablate.py --quick=True: ~1.5 min
