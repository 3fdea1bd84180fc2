"""Apex's tests/L0/run_amp/test_checkpointing.py, ported to mixprec on CPU.

Changes from Apex's file, each for a stated reason: `from mixprec.apex import amp` for
`from apex import amp`; tensors on CPU instead of CUDA ('torch.FloatTensor' for
'torch.cuda.FloatTensor'); unittest classes become pytest functions, the opt-level loops
parametrize; the batches are 4 x 3 x 8 x 8 instead of 16 x 3 x 24 x 24 (fp16 convolutions on
CPU are slow; what is checked does not depend on the size); test_loss_scale_decrease's O1
run starts at 2**15 (see there: a CPU kernel's fp16 sum). Everything else (model, data, steps, assertions) is Apex's.

In Apex's file the comparison of the restored run sits in an `elif` of the branch that runs at
the restore epoch only, so it never ran: Apex's test checks that the checkpoint is fp32 and
loads. Here `amp.load_state_dict` is called after the restore (Apex's FIXME) and the
comparison runs (after the restore epoch, as Apex's comments intend) wherever mixprec
promises it: the same opt level resumes bit for bit (exact, Apex's `assertEqual`). Across
levels the restored run computes in other dtypes, so it is not compared (as in Apex).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn, optim

from mixprec.apex import amp

OPT_LEVELS = ("O0", "O1", "O2", "O3")
FLOAT = "torch.FloatTensor"
SHAPE = (4, 3, 8, 8)


class MyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, 1, 1)
        self.bn1 = nn.BatchNorm2d(6)
        self.param = nn.Parameter(torch.randn(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.param
        x = F.relu(self.conv1(x))
        return self.bn1(x)


def check_state_dict_fp32(state_dict: dict) -> None:
    for key, param in state_dict.items():
        if "num_batches_tracked" in key:
            continue
        assert param.type() == FLOAT, f"Parameter {key} in state_dict not FLOAT"


def train_step(model, optimizer, data, num_losses):
    optimizer.zero_grad()
    output = model(data)
    for idx in range(1, num_losses):  # backward for num_losses - 1
        loss = output.mean() * float(idx)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward(retain_graph=True)
    loss = output.mean() * float(num_losses)  # final backward
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    return output


def compare_models(model_a, model_b) -> None:
    state_a, state_b = model_a.state_dict(), model_b.state_dict()
    assert len(state_a) == len(state_b), "state_dicts have different lengths"
    for key in state_a:
        assert torch.equal(state_a[key], state_b[key]), f"{key} not equal"


@pytest.mark.parametrize("num_losses", [1, 2])
@pytest.mark.parametrize("amp_before_load", [True, False])
@pytest.mark.parametrize("res_opt_level", OPT_LEVELS)
@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_restoring(opt_level, res_opt_level, amp_before_load, num_losses) -> None:
    nb_epochs, nb_epochs_restore = 10, 5
    torch.manual_seed(2809)
    restore_model_initialized = False
    model = MyModel()
    optimizer = optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=opt_level, num_losses=num_losses, verbosity=0
    )
    for epoch in range(nb_epochs):
        x = torch.randn(*SHAPE)
        output = train_step(model, optimizer, x, num_losses)
        # Apex initialises the restored model one step before comparing, so that batchnorm's
        # running stats see the same batches.
        if epoch == nb_epochs_restore - 1:
            if not restore_model_initialized:
                checkpoint = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "amp": amp.state_dict(),
                }
                check_state_dict_fp32(checkpoint["model"])
                restore_model = MyModel()
                restore_optimizer = optim.SGD(restore_model.parameters(), lr=1e-3)
                if amp_before_load:
                    restore_model, restore_optimizer = amp.initialize(
                        restore_model,
                        restore_optimizer,
                        opt_level=res_opt_level,
                        num_losses=num_losses,
                        verbosity=0,
                    )
                restore_model.load_state_dict(checkpoint["model"])
                restore_optimizer.load_state_dict(checkpoint["optimizer"])
                if not amp_before_load:
                    restore_model, restore_optimizer = amp.initialize(
                        restore_model,
                        restore_optimizer,
                        opt_level=res_opt_level,
                        num_losses=num_losses,
                        verbosity=0,
                    )
                # Apex: "FIXME: We cannot test the amp.state_dict in the same script" (its
                # state is one global); here each initialize has its own, so the loss scales
                # are restored too: a torch optimizer loaded before initialize drops them.
                amp.load_state_dict(checkpoint["amp"])
                restore_model_initialized = True
        elif epoch >= nb_epochs_restore and res_opt_level == opt_level:
            restore_output = train_step(restore_model, restore_optimizer, x, num_losses)
            assert torch.equal(output, restore_output), "reference and restored outputs differ"
            compare_models(model, restore_model)


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_loss_scale_decrease(opt_level) -> None:
    num_losses = 3
    nb_decrease_loss_scales = [0, 1, 2]
    nb_decrease_loss_scales_tmp = list(nb_decrease_loss_scales)
    model = MyModel()
    optimizer = optim.SGD(model.parameters(), lr=1e-3)
    # CPU only: torch's fp16 batch_norm backward sums the bias gradient in fp16, and the mean
    # loss's bias gradient is the scale itself (2**16 > fp16's 65504); cuDNN sums in fp32. O1
    # (batch_norm in the input's dtype, as Apex's MATCH_INPUT) so starts one halving lower.
    ceiling = 2.0**15 if opt_level == "O1" else 2.0**24
    model, optimizer = amp.initialize(
        model,
        optimizer,
        opt_level=opt_level,
        num_losses=num_losses,
        verbosity=0,
        max_loss_scale=ceiling,
    )
    if amp._amp_state.opt_properties.loss_scale != "dynamic":
        pytest.skip("Static loss scale set (Apex: 'Skipping opt_level').")
    initial_loss_scales = [amp._amp_state.loss_scalers[i].loss_scale() for i in range(num_losses)]
    for _ in range(max(nb_decrease_loss_scales)):
        optimizer.zero_grad()
        x = torch.randn(16, 3, 24, 24)
        for idx in range(num_losses):
            if nb_decrease_loss_scales_tmp[idx] > 0:
                output = model(x * 2**17)
                nb_decrease_loss_scales_tmp[idx] -= 1
            else:
                output = model(x)
            loss = output.mean()
            with amp.scale_loss(loss, optimizer, loss_id=idx) as scaled_loss:
                scaled_loss.backward(retain_graph=True)
        optimizer.step()
    updated_loss_scales = [amp._amp_state.loss_scalers[i].loss_scale() for i in range(num_losses)]
    for factor, update_ls, init_ls in zip(
        nb_decrease_loss_scales, updated_loss_scales, initial_loss_scales, strict=True
    ):
        assert update_ls == init_ls / 2**factor
    amp_state_dict = amp.state_dict()
    max_decrease_loss_scale = max(nb_decrease_loss_scales)
    for scaler_idx, factor, init_ls in zip(
        amp_state_dict, nb_decrease_loss_scales, initial_loss_scales, strict=True
    ):
        scaler = amp_state_dict[scaler_idx]
        assert scaler["loss_scale"] == init_ls / 2**factor
        assert scaler["unskipped"] == max_decrease_loss_scale - factor
