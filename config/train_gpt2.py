# GPT-2 small (124M) on OpenWebText, nanoGPT's recipe: about 300B tokens over 600k steps.
# 8 GPUs on one node:
#   python data/openwebtext/prepare.py
#   torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py
# 2 nodes of 8 (run on each node, NODE_RANK 0 and 1):
#   torchrun --nnodes=2 --node_rank=$NODE_RANK --nproc_per_node=8 --master_addr=$HEAD_IP --master_port=29500 \
#     train.py config/train_gpt2.py
out_dir = "out-gpt2"
dataset = "openwebtext"
wandb_log = True
wandb_project = "owt"
wandb_run_name = "gpt2-124M"

# 12 sequences x 1024 tokens x 40 accumulation steps (split over the processes) = 491,520 tokens per step
batch_size = 12
block_size = 1024
gradient_accumulation_steps = 40

n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = True
vocab_size = 50304  # GPT-2's 50257 padded to a multiple of 64: faster matmuls

learning_rate = 6e-4
max_iters = 600000
lr_decay_iters = 600000
min_lr = 6e-5
warmup_iters = 2000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0

eval_interval = 1000
eval_iters = 200  # divisible by the number of processes
log_interval = 10
compile = True
