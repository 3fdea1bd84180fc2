"""Naive AMP (AMP_TYPE.NAIVE): fp16 weights and compute, fp32 masters, Megatron's scaler."""

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
    mode=AMP_TYPE.NAIVE,
)

clip_grad_norm = 1.0
