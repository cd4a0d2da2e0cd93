# Induction heads (Olsson et al. 2022, "In-context learning and induction heads"): heads that find the
# earlier occurrence of the current token and attend to what followed it. They need two layers (a
# previous-token head feeding a head in a later layer), and in the paper they form in a sudden phase change
# early in training, with a bump in the loss curve and a drop of the in-context learning score. Here: 1, 2
# and 4 layers of the Quick start's recipe (its model is the 4-layer one), each evaluation logging the best
# induction score and the in-context score on the repeated random-token probe (train.py --log_heads).
# python ablate.py config/ablations/induction.py; python plot.py out-ablations/induction/*/seed1
title = "Induction heads: 1, 2 and 4 layers (Shakespeare characters, the Quick start's recipe)"
base = dict(
    dataset="shakespeare_char", n_head=4, n_embd=128, block_size=128, batch_size=16, max_iters=1500,
    warmup_iters=20, optimizer="muon", learning_rate=1e-2, min_lr=1e-3, beta2=0.99, dropout=0.0,
    pos_emb="rope", norm="rmsnorm", mlp="relu2", bias=False, eval_interval=50, eval_iters=20, log_interval=100,
    log_heads=True,
)
variants = {
    "1 layer": dict(n_layer=1),
    "2 layers": dict(n_layer=2),
    "4 layers (Quick start)": dict(n_layer=4),
}
seeds = [1]
quick = dict(max_iters=300, eval_interval=50, eval_iters=10)  # ablate.py --quick=True: ~1.5 min
