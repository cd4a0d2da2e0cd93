# Shazeer (2020) and the Llama recipe: RMSNorm + SwiGLU + RoPE against GPT-2's LayerNorm + GELU + learned
# positions, one swap at a time, at matched parameters (SwiGLU hidden 341 = 2/3 of GELU's 512).
# python ablate.py config/ablations/modern_recipe.py
title = "GPT-2 recipe vs modern recipe (Shakespeare characters, 4 x 128, 3.3M tokens)"
base = dict(
    dataset="shakespeare_char", n_layer=4, n_head=4, n_embd=128, block_size=128, batch_size=32,
    max_iters=800, warmup_iters=50, learning_rate=2e-3, min_lr=2e-4, beta2=0.99, dropout=0.0,
    eval_interval=100, eval_iters=20, log_interval=100,
)
_gpt2 = dict(pos_emb="learned", norm="layernorm", mlp="gelu", bias=True)  # _: not a study key
variants = {
    "gpt2 (learned, LayerNorm, GELU)": _gpt2,
    "+ RoPE": {**_gpt2, "pos_emb": "rope"},
    "+ RMSNorm": {**_gpt2, "norm": "rmsnorm"},
    "+ SwiGLU": {**_gpt2, "mlp": "swiglu", "mlp_hidden": 341},
    "modern (RoPE, RMSNorm, SwiGLU, no bias)": dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", mlp_hidden=341,
                                                    bias=False),
}
seeds = [1, 2]
quick = dict(max_iters=150, batch_size=16, eval_interval=50, eval_iters=10, seeds=1)  # ablate.py --quick=True: ~1.5 min
