# Wortsman et al. (2023): small models reproduce large-model instabilities at high learning rates
# (attention-logit growth, output-logit divergence); QK-norm and z-loss widen the stable range.
# Each evaluation logs the largest attention logit and the mean log Z of the output.
# python ablate.py config/ablations/stability.py
title = "Learning-rate sensitivity with and without QK-norm and z-loss (4 x 128, 1.2M tokens)"
base = dict(
    dataset="shakespeare_char", n_layer=4, n_head=4, n_embd=128, block_size=128, batch_size=32,
    max_iters=300, warmup_iters=30, beta2=0.95, dropout=0.0, pos_emb="rope", norm="layernorm", mlp="gelu",
    bias=False, eval_interval=50, eval_iters=10, log_interval=50, log_stability=True,
)
variants = {}
for _lr in (3e-3, 3e-2, 3e-1):  # names starting with _ are the file's own, not study keys
    for _name, _keys in (("baseline", {}), ("qk-norm", dict(qk_norm=True)), ("z-loss", dict(z_loss=1e-4)),
                         ("qk-norm + z-loss", dict(qk_norm=True, z_loss=1e-4))):
        variants[f"lr {_lr:g}, {_name}"] = dict(learning_rate=_lr, min_lr=_lr / 10, **_keys)
seeds = [1, 2]
quick = dict(max_iters=60, batch_size=16, eval_interval=20, seeds=1)  # ablate.py --quick=True: ~1.5 min
