# Multi-query associative recall (Zoology's MQAR; data/mqar/prepare.py): which kinds recall a value given
# its key, by kind, at 16 pairs (64-token sequences); --dataset=mqar32 etc. for other pair counts after
# python data/mqar/prepare.py --pairs=32 --out_dir=data/mqar32. Loss and eval.py's accuracy cover the
# queried values only. Parameter counts differ a little by kind (M and N add gates and a convolution).
# python data/mqar/prepare.py --pairs=16 --out_dir=data/mqar16 && python ablate.py config/ablations/mqar.py
title = "MQAR, 16 key-value pairs (64 keys, 64 values), 2 x 128"
base = dict(
    dataset="mqar16", n_layer=2, n_head=4, n_embd=128, block_size=64, batch_size=64,
    max_iters=1500, warmup_iters=50, learning_rate=3e-3, min_lr=3e-4, beta2=0.99, dropout=0.0,
    pos_emb="rope", norm="rmsnorm", mlp="relu2", bias=False, eval_interval=250, eval_iters=10, log_interval=250,
)
variants = {
    "softmax (L)": dict(attn_pattern="L"),
    "linear (R)": dict(attn_pattern="R"),
    "decay (D)": dict(attn_pattern="D"),
    "gated (M)": dict(attn_pattern="M"),
    "gated delta rule (N)": dict(attn_pattern="N"),
    "NL hybrid": dict(attn_pattern="NL"),
}
seeds = [1, 2]
quick = dict(max_iters=200, eval_interval=100, seeds=1)  # ablate.py --quick=True
