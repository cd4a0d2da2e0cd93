# Multi-query associative recall (Zoology's MQAR; data/mqar/prepare.py): which kinds recall a value given
# its key, by kind and by number of key-value pairs (sequences of 4 x pairs tokens: the pairs, then every
# key queried again). Loss and accuracy cover the queried values only. Every kind at about the same
# parameter count (410k): M and N add gates and a convolution, so their MLPs are narrower (mlp_hidden).
# Every pair count sees the same tokens (1,024) and queried values (256) per step. Softmax needs about 2,000
# steps before recall starts (a sudden drop from ln(pairs), the loss of guessing among the values
# present; research log), so the budget is 4,000 steps.
#   for p in 4 8 16; do python data/mqar/prepare.py --pairs=$p --out_dir=data/mqar$p; done
#   python ablate.py config/ablations/mqar.py
title = "MQAR by kind and number of key-value pairs (64 keys, 64 values), 2 x 128, 410k parameters"
base = dict(
    n_layer=2, n_head=4, n_embd=128, max_iters=4000, warmup_iters=100, learning_rate=1e-3,
    min_lr=1e-4, beta2=0.99, dropout=0.0, pos_emb="rope", norm="rmsnorm", mlp="relu2", bias=False,
    eval_interval=500, eval_iters=10, log_interval=500,
)
_kinds = {  # name: (attn_pattern, mlp_hidden for 410,240 +- 80 parameters)
    "softmax (L)": ("L", 512), "linear (R)": ("R", 512), "decay (D)": ("D", 512), "gated (M)": ("M", 440),
    "gated delta rule (N)": ("N", 438), "NL hybrid": ("NL", 475),
}
_pairs = [4, 8, 16]
variants = {f"{kind}, {p} pairs": dict(attn_pattern=pattern, mlp_hidden=hidden, dataset=f"mqar{p}", block_size=4 * p,
                                      batch_size=256 // p)  # 1,024 tokens and 256 queried values per step at any p
            for p in _pairs for kind, (pattern, hidden) in _kinds.items()}
axis = dict(label="key-value pairs", points={f"{kind}, {p} pairs": (kind, p) for p in _pairs for kind in _kinds})
seeds = [1]
quick = dict(max_iters=200, eval_interval=100)  # ablate.py --quick=True
