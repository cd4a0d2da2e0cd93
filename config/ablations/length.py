# Press et al. (2022), "Train Short, Test Long", Figure 1, on a laptop: every position scheme trained at 128
# characters, scored on the whole val split at 128, 256, 512 and 1024 (eval.py --block_size).
# python ablate.py config/ablations/length.py
title = "Length generalisation: trained at 128, evaluated at 128-1024 (Shakespeare characters, 4 x 128)"
base = dict(
    dataset="shakespeare_char", n_layer=4, n_head=4, n_embd=128, block_size=128, batch_size=32,
    max_iters=600, warmup_iters=50, learning_rate=2e-3, min_lr=2e-4, beta2=0.99, dropout=0.0,
    norm="rmsnorm", mlp="relu2", bias=False, eval_interval=200, eval_iters=20, log_interval=100,
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
eval_lengths = [128, 256, 512, 1024]
quick = dict(max_iters=150, batch_size=8, eval_interval=50, eval_iters=10, seeds=1, eval_lengths=[128, 512])  # ~1.5 min
