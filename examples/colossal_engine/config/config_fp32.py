"""Full precision: no fp16 section, so every op runs in fp32."""

# ViT, shrunk from ViT-Base/16 to fit the 8x8 digits: 4x4 patches -> 4 tokens + class token
IMG_SIZE = 8
PATCH_SIZE = 4
HIDDEN_SIZE = 32
DEPTH = 2
NUM_HEADS = 4
MLP_RATIO = 2
DROP_RATE = 0.1
NUM_CLASSES = 10

# hyperparameters; BATCH_SIZE is per process (global batch = BATCH_SIZE x world size)
BATCH_SIZE = 32
LEARNING_RATE = 3e-3
WEIGHT_DECAY = 0.05
NUM_EPOCHS = 3
WARMUP_EPOCHS = 1

clip_grad_norm = 1.0
