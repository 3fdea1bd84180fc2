"""Apex's tests/L0/run_amp/test_add_param_group.py, ported to mixprec on CPU.

Changes from Apex's file, each for a stated reason: `from mixprec.apex import amp` for
`from apex import amp`; tensors on CPU instead of CUDA; the loops over opt level,
zero_before_add and try_accumulation parametrize. The models (an fp32 and an fp16 weight),
`cast_model_type=False`, the loss-scale write, `add_param_group` on the optimizer amp returned,
the three ways of zeroing grads and the comparison with the same steps run without amp
(torch.testing.assert_close at its default tolerances, as Apex) are Apex's.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import Parameter

from mixprec.apex import amp
from mixprec.apex.amp import _amp_state


class MyModel(torch.nn.Module):
    def __init__(self, unique):
        super().__init__()
        self.weight0 = Parameter(unique + torch.arange(2, dtype=torch.float32))
        self.weight1 = Parameter(1.0 + unique + torch.arange(2, dtype=torch.float16))

    @staticmethod
    def ops(input, weight0, weight1):
        return ((input * (weight0.float())) * (weight1.float())).sum()

    def forward(self, input):
        return self.ops(input, self.weight0, self.weight1)


def zero_grad(models, optimizer, how_to_zero):
    if how_to_zero == "none":
        for model in models:
            for param in model.parameters():
                param.grad = None
    elif how_to_zero == "model":
        for model in models:
            model.zero_grad()
    elif how_to_zero == "optimizer":
        optimizer.zero_grad()


@pytest.mark.parametrize("try_accumulation", [True, False])
@pytest.mark.parametrize("zero_before_add", [True, False])
@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_add_param_group(opt_level, zero_before_add, try_accumulation) -> None:
    x = torch.ones(2, dtype=torch.float32)
    model0, model1 = MyModel(1), MyModel(2)
    optimizer = torch.optim.SGD([{"params": model0.parameters(), "lr": 0.25}], momentum=0.125)
    optimizer.zero_grad()
    loss = model0(x)
    loss.backward()
    optimizer.step()
    if zero_before_add:
        optimizer.zero_grad()
    optimizer.add_param_group({"params": model1.parameters(), "lr": 0.5})
    if not zero_before_add:
        optimizer.zero_grad()
    loss = model0(x) + model1(x)
    loss.backward(retain_graph=try_accumulation)
    if try_accumulation:
        loss.backward()
    optimizer.step()
    # once more to make sure the new params pick up momentums properly
    optimizer.zero_grad()
    loss = model0(x) + model1(x)
    loss.backward(retain_graph=try_accumulation)
    if try_accumulation:
        loss.backward()
    optimizer.step()
    reference_params = [p.data.clone() for p in model0.parameters()] + [
        p.data.clone() for p in model1.parameters()
    ]

    for how_to_zero in "none", "model", "optimizer":
        model0, model1 = MyModel(1), MyModel(2)
        optimizer = torch.optim.SGD([{"params": model0.parameters(), "lr": 0.25}], momentum=0.125)
        _amp_state.allow_incoming_model_not_fp32 = True
        [model0, model1], optimizer = amp.initialize(
            [model0, model1], optimizer, opt_level=opt_level, verbosity=0, cast_model_type=False
        )
        _amp_state.allow_incoming_model_not_fp32 = False
        _amp_state.loss_scalers[0]._loss_scale = 4.0

        zero_grad([model0, model1], optimizer, how_to_zero)
        loss = model0(x)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()

        if zero_before_add:
            zero_grad([model0, model1], optimizer, how_to_zero)
        optimizer.add_param_group({"params": model1.parameters(), "lr": 0.5})
        if not zero_before_add:
            zero_grad([model0, model1], optimizer, how_to_zero)

        loss = model0(x) + model1(x)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward(retain_graph=try_accumulation)
        if try_accumulation:
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
        optimizer.step()

        # once more to make sure the new params pick up momentums properly
        zero_grad([model0, model1], optimizer, how_to_zero)
        loss = model0(x) + model1(x)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward(retain_graph=try_accumulation)
        if try_accumulation:
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
        optimizer.step()

        final_params = [p.data.clone() for p in model0.parameters()] + [
            p.data.clone() for p in model1.parameters()
        ]
        for reference, final in zip(reference_params, final_params, strict=True):
            torch.testing.assert_close(
                reference.to(final.dtype),
                final,
                msg=f"opt_level = {opt_level}, how_to_zero = {how_to_zero}, "
                f"zero_before_add = {zero_before_add}",
            )
