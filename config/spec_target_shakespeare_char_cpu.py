# The target of the speculative-decoding benchmark: nanoGPT's 6 x 384 character model (GPT-2's layout, so
# transformers can run it too) at a CPU-sized batch, about 15 minutes on 2 cores.
# python train.py config/spec_target_shakespeare_char_cpu.py && python train.py config/spec_draft_shakespeare_char_cpu.py
# python bench.py sample --out_dir=out-spec-target --draft=out-spec-draft --compare=hf --prompt_file=...
out_dir = "out-spec-target"
dataset = "shakespeare_char"
eval_interval = 300
eval_iters = 20
log_interval = 100

block_size = 256
batch_size = 12
n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.0

optimizer = "muon"
learning_rate = 1e-2
min_lr = 1e-3
warmup_iters = 50
max_iters = 1200
beta2 = 0.99
