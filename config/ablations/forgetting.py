# Linear attention that forgets (issue 39): plain (R), a fixed decay per head (D, RetNet), a data-dependent
# decay (M, Mamba-2's scalar gate) and the gated delta rule (N, Gated DeltaNet), alone and as 3:1 hybrids
# with one softmax layer (Qwen3-Next's and Kimi Linear's ratio), against softmax and a window, at the shape
# and budget of the windows and linear studies.
# python ablate.py config/ablations/forgetting.py
title = "Linear attention that forgets vs softmax (Shakespeare characters, 4 x 128, block 256, 3.3M tokens)"
base = dict(
    dataset="shakespeare_char", n_layer=4, n_head=4, n_embd=128, block_size=256, batch_size=16,
    max_iters=800, warmup_iters=50, learning_rate=2e-3, min_lr=2e-4, beta2=0.99, dropout=0.0,
    pos_emb="rope", norm="rmsnorm", mlp="relu2", bias=False, eval_interval=100, eval_iters=20, log_interval=100,
)
variants = {
    "softmax (L)": dict(attn_pattern="L"),
    "window 32 (S)": dict(attn_pattern="S", attn_window=32),
    "linear (R)": dict(attn_pattern="R"),
    "decay (D)": dict(attn_pattern="D"),
    "gated (M)": dict(attn_pattern="M"),
    "gated delta rule (N)": dict(attn_pattern="N"),
    "RRRL": dict(attn_pattern="RRRL"),
    "DDDL": dict(attn_pattern="DDDL"),
    "MMML": dict(attn_pattern="MMML"),
    "NNNL": dict(attn_pattern="NNNL"),
}
seeds = [1, 2]
eval_lengths = [256, 1024]  # the trained length and 4x, for the kinds that run past it
quick = dict(max_iters=150, batch_size=8, eval_interval=50, eval_iters=10, seeds=1)  # ablate.py --quick=True
