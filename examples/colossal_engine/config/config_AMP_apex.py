"""Apex AMP (AMP_TYPE.APEX): opt_level O1 by default, fp16 autocast over fp32 weights."""

from mixprec import AMP_TYPE

# hyperparameters; BATCH_SIZE is per process (global batch = BATCH_SIZE x world size)
BATCH_SIZE = 64
LEARNING_RATE = 3e-3
WEIGHT_DECAY = 1e-4
NUM_EPOCHS = 5
WARMUP_EPOCHS = 1

# model
HIDDEN_SIZE = 128
NUM_CLASSES = 10

# mixed precision
fp16 = dict(
    mode=AMP_TYPE.APEX,
)

clip_grad_norm = 1.0
