"""Seed 003's "Hands-on Practice" (Steps 1-5) as written, with mixprec in place of colossalai.

    torchrun --nproc_per_node 1 examples/seed_scripts/seed003_booster_amp.py
    mixprec run --nproc_per_node 2 examples/seed_scripts/seed003_booster_amp.py

Changed from the seed: the imports (colossalai -> mixprec; timm, titans and torchvision ->
the offline stand-ins of offline.py); the lines the seed elides are filled in (the launch
call, the constants, the dataset arguments; NUM_EPOCHS and BATCH_SIZE can be set from the
environment); the loop's evident slips are fixed (`enumerate(train_dataloader)` unpacked as
(img, label), `dataloader` for train_dataloader, no optimizer step), `.cuda()` became
`.to(device)` so that CPU runs it, and an epoch line is logged with get_dist_logger.
"""

import os
import tempfile
from pathlib import Path

import torch
from offline import barrier_context, datasets, transforms, vit_base_patch16_224

import mixprec as colossalai
from mixprec.booster import Booster
from mixprec.booster.plugin import TorchDDPPlugin
from mixprec.logging import get_dist_logger
from mixprec.nn.lr_scheduler import LinearWarmupLR

os.environ.setdefault("DATA", tempfile.gettempdir())
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# initialize distributed setting
parser = colossalai.get_default_parser()
args = parser.parse_args()

# launch from torch
colossalai.launch_from_torch(config={})
logger = get_dist_logger()

# define the constants
NUM_EPOCHS = int(os.environ.get("NUM_EPOCHS", 2))
BATCH_SIZE = int(os.environ.get("BATCH_SIZE", 128))

# build model
model = vit_base_patch16_224(drop_rate=0.1)

# build dataloader
with barrier_context():
    train_dataset = datasets.Caltech101(
        root=Path(os.environ["DATA"]),
        download=True,
        transform=transforms.Compose(
            [
                transforms.ToTensor(),
                transforms.Normalize([0.5, 0.5, 0.5], [0.5, 0.5, 0.5]),
            ]
        ),
    )

# build optimizer
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, weight_decay=0.1)

# build loss
criterion = torch.nn.CrossEntropyLoss()

# lr_scheduler
lr_scheduler = LinearWarmupLR(optimizer, warmup_steps=50, total_steps=NUM_EPOCHS)

plugin = TorchDDPPlugin()
train_dataloader = plugin.prepare_dataloader(
    train_dataset, batch_size=BATCH_SIZE, shuffle=True, drop_last=True
)
booster = Booster(mixed_precision="fp16", plugin=plugin)

# boost model, optimizer, criterion, dataloader, lr_scheduler
model, optimizer, criterion, train_dataloader, lr_scheduler = booster.boost(
    model, optimizer, criterion, train_dataloader, lr_scheduler
)

for epoch in range(NUM_EPOCHS):
    for img, label in train_dataloader:
        img = img.to(device)
        label = label.to(device)
        output = model(img)
        loss = criterion(output, label)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
    lr_scheduler.step()
    logger.info(
        f"Epoch {epoch} - train loss: {loss.item():.5}, lr: {lr_scheduler.get_last_lr()[0]:.5g}",
        ranks=[0],
    )
