"""Torch AMP (AMP_TYPE.TORCH): fp32 weights, fp16 autocast, dynamic loss scale (torch defaults)."""

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
    mode=AMP_TYPE.TORCH,
)

clip_grad_norm = 1.0
