# Sliding windows and local/global hybrids (Beltagy et al. 2020; Mistral; Gemma's SSSL; GPT-3's SL): what a
# window costs in val bits per byte at block_size 256, where it saves decoding time and cache memory.
# python ablate.py config/ablations/windows.py
title = "Sliding windows vs full attention (Shakespeare characters, 4 x 128, block 256, 3.3M tokens)"
base = dict(
    dataset="shakespeare_char", n_layer=4, n_head=4, n_embd=128, block_size=256, batch_size=16,
    max_iters=800, warmup_iters=50, learning_rate=2e-3, min_lr=2e-4, beta2=0.99, dropout=0.0,
    pos_emb="rope", norm="rmsnorm", mlp="relu2", bias=False, eval_interval=100, eval_iters=20, log_interval=100,
)
variants = {
    "full (L)": dict(attn_pattern="L"),
    "window 64 (S)": dict(attn_pattern="S", attn_window=64),
    "window 32 (S)": dict(attn_pattern="S", attn_window=32),
    "SL, window 32": dict(attn_pattern="SL", attn_window=32),
    "SSSL, window 32": dict(attn_pattern="SSSL", attn_window=32),
}
seeds = [1, 2]
quick = dict(max_iters=150, batch_size=8, eval_interval=50, eval_iters=10, seeds=1)  # ablate.py --quick=True: ~1.5 min
