# Extending a RoPE model's context from 128 to 512 characters (Chen et al. 2023; Peng et al. 2023): as is,
# with position interpolation and no training, and after a short fine-tune at 512 (5% of the original
# steps) with linear and YaRN x4 scaling; against a model trained at 512 from scratch on the same tokens.
# python ablate.py config/ablations/context_extension.py
title = "Context extension: RoPE trained at 128, run at 512 (Shakespeare characters, 4 x 128)"
base = dict(
    dataset="shakespeare_char", n_layer=4, n_head=4, n_embd=128, block_size=128, batch_size=32,
    max_iters=600, warmup_iters=50, learning_rate=2e-3, min_lr=2e-4, beta2=0.99, dropout=0.0,
    norm="rmsnorm", mlp="relu2", bias=False, eval_interval=200, eval_iters=20, log_interval=100, pos_emb="rope",
)
# tokens: 600 steps x 32 x 128 = 2.46M; a fine-tune of 30 steps at 512 adds 0.49M; from scratch at 512,
# 180 steps x 32 x 512 = 2.95M, the same total
variants = {
    "rope @128": dict(),
    "linear x4, fine-tuned @512": dict(block_size=512, rope_scaling="linear", rope_factor=4.0, max_iters=630,
                                       eval_interval=30),
    "yarn x4, fine-tuned @512": dict(block_size=512, rope_scaling="yarn", rope_factor=4.0, max_iters=630,
                                     eval_interval=30),
    "rope @512 from scratch": dict(block_size=512, max_iters=180, warmup_iters=15, eval_interval=60),
}
continue_from = {"linear x4, fine-tuned @512": "rope @128", "yarn x4, fine-tuned @512": "rope @128"}
eval_as = {
    "rope @128, linear x4, no training": ("rope @128", dict(rope_scaling="linear", rope_factor=4.0)),
    "rope @128, yarn x4, no training": ("rope @128", dict(rope_scaling="yarn", rope_factor=4.0)),
}
seeds = [1, 2]
eval_lengths = [128, 512]
# ablate.py --quick=True: about 1.5 minutes; an eighth of the batch, the same steps (the fine-tunes continue
# the 600-step run)
quick = dict(batch_size=4, eval_iters=10, seeds=1)
