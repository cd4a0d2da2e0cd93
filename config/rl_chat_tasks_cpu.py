# Reinforcement learning with verifiable rewards (GRPO's groups) after the README's chat fine-tune, on a CPU.
# python data/chat_tasks/prepare.py --tokenizer_from=out-shakespeare-char-cpu --rl=2000   # rl.jsonl: 500 fresh prompts a task
# python train.py config/sft_chat_tasks_cpu.py && python rl.py config/rl_chat_tasks_cpu.py
# 200 steps of 16 prompts x 16 replies, about 4 minutes on 2 cores with an evaluation every 50 steps (all
# 3,125 held-out conversations, greedy; pass@16 on 32 a task). What it does, from the README's fine-tune and
# from an earlier one: docs/ablations.md, study 15 (past 200 steps count, which is not trained, drifts down).
init_from = "out-chat-tasks"
out_dir = "out-rl-chat-tasks"
prompts = "data/chat_tasks/rl.jsonl"
eval_chats = "data/chat_tasks/val.jsonl"
tasks = "reverse,shout"  # not count (RL on it lowered its greedy exact match), nor speaker (no sampled reply is ever right)
pass_per_task = 32
eval_interval = 50
log_interval = 10

group_size = 16
prompts_per_step = 16
temperature = 1.0
max_new_tokens = 32
max_iters = 200
learning_rate = 2e-4  # 1e-3 and 3e-4 collapsed (entropy to ~0.01, reverse and shout down); 5e-5 barely moved
min_lr = 2e-4
