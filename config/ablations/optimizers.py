# Jordan et al. (2024): Muon (orthogonalised momentum for the blocks' matrices, AdamW for embeddings,
# norms and head) reaches a given loss in fewer steps than AdamW.
# python ablate.py config/ablations/optimizers.py
title = "AdamW vs Muon (Shakespeare characters, 4 x 128, 3.3M tokens)"
base = dict(
    dataset="shakespeare_char", n_layer=4, n_head=4, n_embd=128, block_size=128, batch_size=32,
    max_iters=800, warmup_iters=50, beta2=0.99, dropout=0.0, pos_emb="rope", norm="rmsnorm", mlp="relu2",
    bias=False, eval_interval=50, eval_iters=20, log_interval=100,
)
variants = {
    "adamw lr 2e-3": dict(optimizer="adamw", learning_rate=2e-3, min_lr=2e-4),
    "adamw lr 4e-3": dict(optimizer="adamw", learning_rate=4e-3, min_lr=4e-4),
    "muon lr 4e-3": dict(optimizer="muon", learning_rate=4e-3, min_lr=4e-4),
    "muon lr 1e-2": dict(optimizer="muon", learning_rate=1e-2, min_lr=1e-3),
}
seeds = [1, 2]
targets = [2.0, 1.8, 1.7, 1.6]
quick = dict(max_iters=150, batch_size=16, eval_interval=50, eval_iters=10, seeds=1)  # ablate.py --quick=True: ~1.5 min
