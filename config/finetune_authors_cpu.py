# A classifier fine-tuned from BERT's masked-token run (config/train_mlm_shakespeare_char_cpu.py): who
# wrote a 62-character snippet, Shakespeare or Tolstoy (python data/authors/prepare.py)? The encoder's
# blocks and embeddings are the masked-token run's; the head is new: BERT's pooler (dense + tanh on
# [CLS]'s final state) and a classifier. Held-out accuracy: python eval.py --out_dir=out-authors
out_dir = "out-authors"
init_from = "out-mlm-shakespeare"
family = "encoder"  # (the run's: stated, so the file reads as what it trains)
dataset = "authors"
head = "classify"
pooler = True
dropout = 0.1

batch_size = 32
max_iters = 600
eval_interval = 200
eval_iters = 63  # 2,016 examples: the whole val split (2,000), in order
log_interval = 50
learning_rate = 3e-4
min_lr = 3e-5
warmup_iters = 60
beta2 = 0.99
device = "cpu"
dtype = "float32"
