# The chapter's vision transformer on scikit-learn's digits (python data/images/prepare.py digits): patch
# size (2x2: 16 tokens, 4x4: 4 tokens), the positions (learned, none: a bag of patches, sinusoidal), and the
# augmentation the chapter says ViTs need (image_shift=0: no shifts). Held-out accuracy over the 360 images.
# python ablate.py config/ablations/vit_digits.py [--quick=True]
title = "ViT on 8x8 digits: patch size, positions, augmentation (4 x 64, 1,437 training images)"
base = dict(
    dataset="digits", family="encoder", head="classify", n_classes=10, image_size=8, patch_size=2, channels=1,
    block_size=17, n_layer=4, n_head=4, n_embd=64, mlp="gelu_exact", dropout=0.1, image_shift=1,
    batch_size=64, max_iters=8000, eval_interval=1000, eval_iters=10, log_interval=500, learning_rate=2e-3,
    min_lr=1e-4, warmup_iters=100, weight_decay=0.05, beta2=0.99, dtype="float32",
)
variants = {
    "patch 2, learned positions": {},
    "patch 4, learned positions": dict(patch_size=4, block_size=5),
    "patch 2, no positions": dict(pos_emb="none"),
    "patch 2, sinusoidal positions": dict(pos_emb="sinusoidal"),
    "patch 2, learned, no shifts": dict(image_shift=0),
}
seeds = [1, 2, 3]
quick = dict(max_iters=600, eval_interval=300, seeds=1)  # ablate.py --quick=True: about 1.5 minutes
