"""Apex's tests/L0/run_amp/test_cache.py, ported to mixprec on CPU.

Changes from Apex's file, each for a stated reason: `from mixprec.apex import amp` for
`from apex import amp`; tensors on CPU instead of CUDA; the type checks compare dtypes (Apex's
'torch.cuda.HalfTensor' strings name the device); unittest methods become pytest functions.
The models, the O1 initialize, the loss-scale write (`_amp_state.loss_scalers[0]._loss_scale
= 4.0`), the train / eval / train sequence and the comparison with an fp32 reference gradient
(torch.testing.assert_close at its default tolerances, as Apex) are Apex's.
"""

from __future__ import annotations

import pytest
import torch

from mixprec.apex import amp
from mixprec.apex.amp import _amp_state


def get_reference_grad(i, w, ops):
    # new tensors, not Parameters: nothing cached from the amp run can reach them
    fp32_i = i.detach().clone().float()
    fp32_w = w.detach().clone().float().requires_grad_()
    loss = ops(fp32_i, fp32_w)
    loss.backward()
    return fp32_w.grad


class WhitelistModule(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(8 * 8, dtype=dtype).view(8, 8))

    @staticmethod
    def ops(input, weight):
        return (input.mm(weight)).mm(weight).sum()

    def forward(self, input):
        return self.ops(input, self.weight)


class BlacklistModule(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(2 * 8, dtype=dtype).view(2, 8))

    @staticmethod
    def ops(input, weight):
        return (input + torch.pow(weight, 2) + torch.pow(weight, 2)).sum()

    def forward(self, input):
        return self.ops(input, self.weight)


class PromoteModule(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(2 * 8, dtype=dtype).view(2, 8))

    @staticmethod
    def ops(input, weight):
        return ((input * weight) * weight).sum()

    def forward(self, input):
        return self.ops(input, self.weight)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("module", [WhitelistModule, BlacklistModule, PromoteModule])
def test_train_eval_train(module, dtype) -> None:
    x = torch.ones((2, 8), dtype=torch.float32)
    model = module(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    _amp_state.allow_incoming_model_not_fp32 = True
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    _amp_state.allow_incoming_model_not_fp32 = False

    def training_step():
        for param in model.parameters():
            param.grad = None
        loss = model(x).sum()
        _amp_state.loss_scalers[0]._loss_scale = 4.0
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        assert len([p.grad for p in model.parameters() if p.grad is not None]) == 1
        assert model.weight.grad.dtype == model.weight.dtype
        reference_grad = get_reference_grad(x, model.weight, model.ops)
        torch.testing.assert_close(model.weight.grad.float(), reference_grad)
        model.weight.data -= 1.0

    training_step()  # simulates the first epoch
    with torch.no_grad():  # simulates eval
        model(x).sum()
    training_step()  # simulates resuming training after eval
    _amp_state.handle._deactivate()
