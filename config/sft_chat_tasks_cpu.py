# Supervised fine-tuning of the Quick start's character model on data/chat_tasks (conversations), on a CPU.
# python data/chat_tasks/prepare.py --tokenizer_from=out-shakespeare-char-cpu && python train.py config/sft_chat_tasks_cpu.py
# LoRA instead of every weight: add --lora_rank=8 --learning_rate=1e-2 --out_dir=out-chat-tasks-lora
# 3000 steps of 32 over 20,000 conversations (4.8 epochs): at 600 steps over 5,000 the held-out exact match
# was 0.06-0.26 depending on the base model's last bits (its precision, its CPU, its seed): reverse and shout
# are learned in a jump whose step varies. At 3000 every base we tried lands within a few points
# (docs/research_log.md, 2026-12-04).
init_from = "out-shakespeare-char-cpu"
dataset = "chat_tasks"
out_dir = "out-chat-tasks"
eval_interval = 500
eval_iters = 20
log_interval = 100

batch_size = 32  # conversations per step (each a padded row)
optimizer = "adamw"
learning_rate = 2e-3
min_lr = 2e-4
warmup_iters = 30
max_iters = 3000
weight_decay = 0.0
beta2 = 0.99
