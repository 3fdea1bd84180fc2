"""The README's Python snippets run as written (on a tiny model and data they are handed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from dist_utils import free_port

import mixprec

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def namespace(tmp_path: Path) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    dataset = torch.utils.data.TensorDataset(x, y)
    loader = torch.utils.data.DataLoader(dataset, batch_size=4)
    criterion = torch.nn.CrossEntropyLoss()
    loss = criterion(model(x), y)
    return {
        "torch": torch,
        "model": model,
        "optimizer": optimizer,
        "criterion": criterion,
        "loader": loader,
        "train_loader": loader,
        "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1),
        "x": x,
        "y": y,
        "loss": loss,
        "data": x,
        "label": torch.randn(8, 4),
        "mse": torch.nn.MSELoss(),
    }


def test_readme_has_snippets() -> None:
    assert len(BLOCKS) >= 6


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_snippet_runs(index: int, tmp_path: Path, monkeypatch) -> None:
    code = BLOCKS[index].replace('"ckpt/', f'"{tmp_path}/')
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    for key, value in {**env, "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    ns = namespace(tmp_path)
    if "Booster(" in code and "launch" not in code:  # DDP needs a process group, as after launch
        mixprec.launch({}, rank=0, world_size=1, host="127.0.0.1", port=free_port(), verbose=False)
    try:
        exec(compile(code, f"README.md block {index}", "exec"), ns)
    finally:
        from mixprec.launch import destroy

        destroy()
