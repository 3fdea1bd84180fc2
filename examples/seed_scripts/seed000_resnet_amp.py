"""Seed 000's "train the model" script as written, with mixprec in place of colossalai.

    torchrun --nproc_per_node 1 examples/seed_scripts/seed000_resnet_amp.py
    mixprec run --nproc_per_node 2 examples/seed_scripts/seed000_resnet_amp.py
    mixprec run --nproc_per_node 1 examples/seed_scripts/seed000_resnet_amp.py --full

Run time on the reference CPU (2-core AMD EPYC, no fp16 kernels, so fp16 convolutions are
slow; OMP_NUM_THREADS=1): the default 2 epochs (3 passes) took 9.3 min under `mixprec run`
while the shared machine's load average fell from 8 to 4 (idle is faster); `--full` (the
seed's 200 epochs) about 2.7 h. A progress bar (tqdm, rank 0) counts each pass's batches.

Changed from the seed, and nothing else: the imports (colossalai -> mixprec; torchvision ->
the offline stand-ins of offline.py: digits for CIFAR10, a narrow resnet34); NUM_EPOCHS is 2
unless `--full` (the seed's 200) or the environment sets it, and the fp16 mode can be set from
the environment too (NUM_EPOCHS, AMP_MODE: torch, naive, apex); a tqdm bar wraps the loaders;
`.cuda()` became `.to(device)` so that CPU runs it; `logger = get_dist_logger()` is added (the
seed imports get_dist_logger and uses `logger` without creating it); DATA defaults to a
temporary folder (nothing is downloaded).
"""

import os
import sys
import tempfile
from pathlib import Path

import torch
from offline import CIFAR10, resnet34, transforms
from tqdm import tqdm

import mixprec as colossalai
from mixprec.amp import AMP_TYPE
from mixprec.config import gpc
from mixprec.logging import get_dist_logger
from mixprec.nn.lr_scheduler import CosineAnnealingLR
from mixprec.utils import get_dataloader

os.environ.setdefault("DATA", tempfile.gettempdir())
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
logger = get_dist_logger()

CONFIG = dict(
    BATCH_SIZE=128,
    NUM_EPOCHS=int(os.environ.get("NUM_EPOCHS", 200 if "--full" in sys.argv[1:] else 2)),
    fp16=dict(
        mode=AMP_TYPE(os.environ.get("AMP_MODE", "torch")),
    ),
)
if CONFIG["fp16"]["mode"] == AMP_TYPE.TORCH:
    # below are default values for grad scaler
    CONFIG["fp16"].update(
        init_scale=2.0**16,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=2000,
        enabled=True,
    )

# launch distributed setting
colossalai.launch_from_torch(config=CONFIG)

# build your model, optimizer, criterion, dataloaders
model = resnet34(num_classes=10)
criterion = torch.nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
lr_scheduler = CosineAnnealingLR(optimizer, total_steps=gpc.config.NUM_EPOCHS)
train_dataset = CIFAR10(
    root=Path(os.environ["DATA"]),
    download=True,
    transform=transforms.Compose(
        [
            transforms.RandomCrop(size=32, padding=4),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(mean=[0.4914, 0.4822, 0.4465], std=[0.2023, 0.1994, 0.2010]),
        ]
    ),
)
train_dataloader = get_dataloader(
    dataset=train_dataset,
    shuffle=True,
    batch_size=gpc.config.BATCH_SIZE,
    num_workers=1,
    pin_memory=True,
)

# by reading global variable gpc.config,
# colossalai.initialize function convert the model, optimizer and criterion
# to mixed precision
engine, train_dataloader, _, _ = colossalai.initialize(
    model, optimizer, criterion, train_dataloader
)

# train
engine.train()
show = int(os.environ.get("RANK", 0)) == 0  # one progress bar, on rank 0
for img, label in tqdm(train_dataloader, desc="first pass", disable=not show):
    img, label = img.to(device), label.to(device)
    engine.zero_grad()
    output = engine(img)
    loss = engine.criterion(output, label)
    engine.backward(loss)
    engine.step()

# Normal training process:
for epoch in range(gpc.config.NUM_EPOCHS):
    # execute a training iteration
    engine.train()
    for img, label in tqdm(train_dataloader, desc=f"epoch {epoch}", disable=not show):
        img = img.to(device)
        label = label.to(device)

        # set gradients to zero
        engine.zero_grad()

        # run forward pass
        output = engine(img)

        # compute loss value and run backward pass
        train_loss = engine.criterion(output, label)
        engine.backward(train_loss)

        # update parameters
        engine.step()

    # update learning rate
    lr_scheduler.step()

    logger.info(
        f"Epoch {epoch} - train loss: {train_loss:.5}, lr: {lr_scheduler.get_last_lr()[0]:.5g}",
        ranks=[0],
    )
