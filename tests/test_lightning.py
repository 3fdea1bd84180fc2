"""mixprec inside Lightning: one precision plugin for the Trainer and for Fabric.

Digits accuracy per mode against Lightning's own fp32, resume through Lightning's checkpoint,
a skipped step that changes nothing, and DDP over 2 gloo processes launched by Fabric.
"""

from __future__ import annotations

import gc
import logging
import warnings

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning")  # an optional extra (the dev extra installs it)

from mixprec.fp8 import Float8Linear  # noqa: E402
from mixprec.integrations.lightning import MixprecPrecision  # noqa: E402

for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
    logging.getLogger(name).setLevel(logging.ERROR)  # no banners, tips or summaries


def digits(n_train: int = 1400) -> tuple[torch.Tensor, ...]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0  # 64 features: 16-aligned for fp8
    y = torch.tensor(data.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, test = perm[:n_train], perm[1400:]
    return x[train], y[train], x[test], y[test]


class DigitsNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, 128), nn.ReLU(), nn.LayerNorm(128), nn.Linear(128, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def loader(
    x: torch.Tensor, y: torch.Tensor, *, shuffle: bool = True
) -> torch.utils.data.DataLoader:
    data = torch.utils.data.TensorDataset(x, y)
    generator = torch.Generator().manual_seed(1)
    return torch.utils.data.DataLoader(data, batch_size=32, shuffle=shuffle, generator=generator)


def trainer(plugin: MixprecPrecision | None, **kwargs: object) -> L.Trainer:
    options = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    options.update(kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice about num_workers and the like
        return L.Trainer(plugins=[plugin] if plugin else None, **options)


def fit_digits(plugin: MixprecPrecision | None) -> tuple[float, DigitsNet]:
    x, y, x_test, y_test = digits()
    torch.manual_seed(0)
    model = DigitsNet()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(plugin, max_epochs=2).fit(model, loader(x, y))
    with torch.no_grad():
        out = model.net(x_test.to(model.net[0].weight.dtype))
    return (out.argmax(1) == y_test).float().mean().item() * 100, model


@pytest.fixture(scope="module")
def lightning_fp32_accuracy() -> float:
    return fit_digits(None)[0]  # Lightning's own fp32 ("32-true"), no plugin


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bf16", "fp16", "fp16_naive", "fp16_apex"])
def test_trainer_digits_per_mode_within_one_point_of_lightning_fp32(
    mode: str, lightning_fp32_accuracy: float
) -> None:
    plugin = MixprecPrecision(mode)
    accuracy, model = fit_digits(plugin)
    # 1 point = 4 of the 397 test digits: seed noise of fp32 itself is about that size
    assert abs(accuracy - lightning_fp32_accuracy) <= 1.0, (mode, accuracy, lightning_fp32_accuracy)
    stats = plugin.skip_stats
    assert stats.steps == 88  # 2 epochs of 44 batches: every step went through mixprec
    if mode == "fp16_naive":  # fp16 params, fp32 masters: Lightning's "16-true" has no masters
        assert model.net[0].weight.dtype == torch.float16
        assert plugin.optimizer.hp_masters[0].dtype == torch.float32
        assert model.net[2].weight.dtype == torch.float32  # LayerNorm kept fp32
        assert stats.warmup_skips > 0  # Colossal's 2**32 initial scale warms up


def test_fp8_and_op_lists_run_on_cpu_under_fabric() -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=MixprecPrecision("fp8"))
    torch.manual_seed(0)
    model = DigitsNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)
    assert isinstance(model.module.net[0], Float8Linear)  # 64 -> 128: converted
    x, y, *_ = digits(n_train=64)
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x).float(), y)  # model(): Fabric's precision
        fabric.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    lists = MixprecPrecision("bf16", custom_black_list=["linear"])
    with lists.forward_context():  # a black-listed op runs in fp32 under bf16 autocast
        out = nn.functional.linear(torch.randn(2, 4), torch.randn(3, 4))
    assert out.dtype == torch.float32


def test_fabric_skipped_step_leaves_everything_bitwise_unchanged() -> None:
    plugin = MixprecPrecision("fp16_naive", initial_scale=2.0**8)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=plugin)
    torch.manual_seed(0)
    model = DigitsNet()
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=3e-3))
    x, y, *_ = digits(n_train=32)

    def step(poison: bool) -> None:
        optimizer.zero_grad()
        fabric.backward(nn.functional.cross_entropy(model(x).float(), y))
        if poison:
            next(model.parameters()).grad[0, 0] = float("inf")
        optimizer.step()

    step(False)
    mp = plugin.optimizer
    before = {
        "params": [p.detach().clone() for p in model.parameters()],
        "masters": [m.detach().clone() for m in mp.hp_masters],
        "state": {k: v.clone() for s in mp.optim.state.values() for k, v in s.items()},
    }
    step(True)
    assert mp.last_result.skipped and plugin.skip_stats.skipped_steps == 1
    for now, then in zip(model.parameters(), before["params"], strict=True):
        torch.testing.assert_close(now, then, rtol=0, atol=0)  # exact: a skip changes nothing
    for now, then in zip(mp.hp_masters, before["masters"], strict=True):
        torch.testing.assert_close(now, then, rtol=0, atol=0)
    after = {k: v for s in mp.optim.state.values() for k, v in s.items()}
    for key, value in before["state"].items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0)  # Adam's step count too
    assert plugin.optimizer.scaler.scale == 2.0**8  # hysteresis 2: one overflow does not back off


def test_trainer_resume_from_its_checkpoint_equals_the_uninterrupted_run(tmp_path) -> None:
    x, y, *_ = digits(n_train=256)  # 8 steps per epoch; no shuffle: the same order on resume

    def run(epochs: int, ckpt: str | None = None) -> tuple[DigitsNet, MixprecPrecision, L.Trainer]:
        torch.manual_seed(0)
        model, plugin = DigitsNet(), MixprecPrecision("fp16_naive")
        fit = trainer(plugin, max_epochs=epochs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fit.fit(model, loader(x, y, shuffle=False), ckpt_path=ckpt)
        return model, plugin, fit

    whole, whole_plugin, _ = run(3)
    half, _, half_trainer = run(2)  # 16 steps: inside fp16_naive's warm-up skips
    half_trainer.save_checkpoint(tmp_path / "half.ckpt")
    resumed, resumed_plugin, _ = run(3, str(tmp_path / "half.ckpt"))
    counts = [
        (s.steps, s.skipped_steps, s.last_scale)
        for s in (resumed_plugin.skip_stats, whole_plugin.skip_stats)
    ]
    assert counts[0] == counts[1] and counts[0][1] > 0  # the warm-up skips happened before
    for a, b in zip(resumed.parameters(), whole.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # masters and scaler came back exactly
    for a, b in zip(
        resumed_plugin.optimizer.hp_masters, whole_plugin.optimizer.hp_masters, strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def ddp_worker(fabric: L.Fabric) -> list[int]:
    torch.manual_seed(0)  # the same init on both ranks (DDP also broadcasts rank 0's)
    model = DigitsNet()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y, *_ = digits(n_train=64)
    shard = slice(fabric.global_rank * 32, (fabric.global_rank + 1) * 32)
    skipped = []
    for step in range(3):
        optimizer.zero_grad()
        fabric.backward(nn.functional.cross_entropy(model(x[shard]).float(), y[shard]))
        if step == 1 and fabric.global_rank == 1:  # only rank 1 overflows
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        optimizer.step()
        skipped.append(int(fabric.strategy.precision.optimizer.last_result.skipped))
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    gathered = fabric.all_gather(flat)
    torch.testing.assert_close(gathered[1], gathered[0], rtol=0, atol=0)  # ranks agree bitwise
    # Fabric's spawn launcher returns without tearing the process group down, and a process
    # exiting with live gloo threads aborted once in CI ("terminate called without an active
    # exception"): meet, free DDP's reducer, then destroy the group, as tests/dist_utils does.
    fabric.barrier()
    del model, optimizer
    gc.collect()
    torch.distributed.destroy_process_group()
    return skipped


@pytest.mark.distributed
def test_fabric_ddp_two_gloo_processes_skip_together() -> None:
    fabric = L.Fabric(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        plugins=MixprecPrecision("fp16_naive", initial_scale=2.0**4),
    )
    skipped = fabric.launch(ddp_worker)
    assert skipped == [0, 1, 0]  # rank 1's inf skipped the step on rank 0 too


def test_autocast_follows_the_accelerator_not_whether_cuda_exists(monkeypatch) -> None:
    plugin = MixprecPrecision("bf16")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=plugin)
    model = fabric.setup(nn.Linear(4, 3))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU the run does not use
    out = model(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16  # CPU autocast ran: the accelerator's device
