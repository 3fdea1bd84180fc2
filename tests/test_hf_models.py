"""Tiny Hugging Face models (BERT, GPT-2) built from a config through every face and mode.

Offline and without weights (HF_HUB_OFFLINE=1, from_config only). Each run takes a few steps
on one fixed batch: the ModelOutput must come back as a ModelOutput and the loss must fall.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from torch import nn

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device")

transformers = pytest.importorskip("transformers")  # the dev extra installs it
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # from config only: nothing is fetched

import mixprec  # noqa: E402
from mixprec import AMP_TYPE  # noqa: E402

STEPS = 4
LR = 1e-2  # one fixed batch: a high rate makes the fall visible within STEPS


def bert() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
        num_labels=3,
    )
    torch.manual_seed(0)
    batch = {"input_ids": torch.randint(0, 64, (4, 8)), "labels": torch.tensor([0, 1, 2, 1])}
    return transformers.BertForSequenceClassification(config), batch


def gpt2() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (4, 8))
    return transformers.GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids}


Step = Callable[[dict[str, torch.Tensor]], object]


def via_convert_to_amp(mode: object, config: dict | None = None) -> Callable[[nn.Module], Step]:
    def setup(model: nn.Module) -> Step:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        model, optimizer, _ = mixprec.convert_to_amp(model, optimizer, None, mode, config)

        def step(batch: dict[str, torch.Tensor]) -> object:
            optimizer.zero_grad()
            out = model(**batch)
            optimizer.backward(out.loss)
            optimizer.step()
            return out

        return step

    return setup


def via_booster(mixed_precision: object) -> Callable[[nn.Module], Step]:
    def setup(model: nn.Module) -> Step:
        booster = mixprec.Booster(
            device=torch.get_default_device().type, mixed_precision=mixed_precision
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        model, optimizer, *_ = booster.boost(model, optimizer)

        def step(batch: dict[str, torch.Tensor]) -> object:
            optimizer.zero_grad()
            out = model(**batch)
            booster.backward(out.loss, optimizer)
            optimizer.step()
            return out

        return step

    return setup


def via_engine(model: nn.Module) -> Step:
    config = {"fp16": {"mode": AMP_TYPE.NAIVE, "initial_scale": 2.0**10}}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    engine, *_ = mixprec.initialize(model, optimizer, config=config, verbose=False)

    def step(batch: dict[str, torch.Tensor]) -> object:
        engine.zero_grad()
        out = engine(**batch)
        engine.backward(out.loss)
        engine.step()
        return out

    return step


def via_apex(opt_level: str) -> Callable[[nn.Module], Step]:
    def setup(model: nn.Module) -> Step:
        from mixprec.apex import amp

        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)

        def step(batch: dict[str, torch.Tensor]) -> object:
            optimizer.zero_grad()
            out = model(**batch)
            with amp.scale_loss(out.loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            return out

        return step

    return setup


def via_paddle_o1(model: nn.Module) -> Step:
    from mixprec import paddle

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scaler = paddle.GradScaler(init_loss_scaling=1024)

    def step(batch: dict[str, torch.Tensor]) -> object:
        optimizer.zero_grad()
        with paddle.auto_cast(level="O1", dtype="bfloat16"):
            out = model(**batch)
        scaler.scale(out.loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return out

    return step


FACES = {
    "convert_to_amp fp32": via_convert_to_amp("fp32"),
    "convert_to_amp bf16": via_convert_to_amp("bf16"),
    "convert_to_amp TORCH": via_convert_to_amp(AMP_TYPE.TORCH),
    "convert_to_amp NAIVE": via_convert_to_amp(AMP_TYPE.NAIVE, {"initial_scale": 2.0**10}),
    "convert_to_amp fp8": via_convert_to_amp("fp8"),
    # 2**10, not Colossal's 2**32: ~22 fewer warm-up skips, so a few steps show the fall
    "booster fp16_naive": via_booster(mixprec.FP16NaiveMixedPrecision(initial_scale=2.0**10)),
    "booster bf16": via_booster("bf16"),
    "engine NAIVE": via_engine,
    "apex O2": via_apex("O2"),
    "paddle O1": via_paddle_o1,
}


@pytest.mark.slow
@pytest.mark.parametrize("face", list(FACES))
@pytest.mark.parametrize("build", [bert, gpt2], ids=["bert", "gpt2"])
def test_hf_model_trains_through_every_face(face: str, build: Callable) -> None:
    model, batch = build()
    step = FACES[face](model)
    losses = []
    for _ in range(STEPS):
        out = step(batch)
        assert isinstance(out, transformers.utils.ModelOutput), type(out)  # passes through
        assert out.logits.shape[0] == 4
        losses.append(out.loss.item())
    # the warm-up of a dynamic scale may skip early steps; the loss must still fall by the end
    assert losses[-1] < losses[0], (face, losses)
