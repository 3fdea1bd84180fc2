"""Apex's tests/L0/run_amp/test_multiple_models_optimizers_losses.py, ported to mixprec on CPU.

Changes from Apex's file, each for a stated reason: `from mixprec.apex import amp` for
`from apex import amp`; tensors on CPU; the outer loops over opt level, zeroing style and
loss-scaler count parametrize; the reference runs are shared helpers. The models (an fp32 and
an fp16 weight each), `cast_model_type=False`, the loss-scale writes, the infs injected into
fp16 or fp32 grads inside `scale_loss`, the per-iteration master-grad checks and the final
comparisons (torch.allclose at its defaults, as Apex) are Apex's.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import Parameter

from mixprec.apex import amp
from mixprec.apex.amp import _amp_state

OPT_LEVELS = ("O0", "O1", "O2", "O3")
HOW_TO_ZERO = ("none", "model", "optimizer")


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


X = torch.ones(2, dtype=torch.float32)


def grads(*models):
    return [p.grad.data.clone() for m in models for p in m.parameters()]


def params(*models):
    return [p.data.clone() for m in models for p in m.parameters()]


def zero(how_to_zero, models, optimizers):
    if how_to_zero == "none":
        for model in models:
            for param in model.parameters():
                param.grad = None
    elif how_to_zero == "model":
        for model in models:
            model.zero_grad()
    else:
        for opt in optimizers:
            opt.zero_grad()


def injections(opt_level, which_models_for=None):
    """Apex's (inject_inf, inject_inf_loc, which_backward[, which_model]) cases."""
    cases = [(-1, None, None, None)]
    if opt_level in ("O1", "O2"):
        for inject_inf in (0, 1):
            for loc in ("fp16", "fp32"):
                for which_backward in (0, 1):
                    models = (
                        (None,) if which_models_for is None else which_models_for[which_backward]
                    )
                    cases += [(inject_inf, loc, which_backward, m) for m in models]
    return cases


def inject(model, loc):
    if loc == "fp32":
        model.weight0.grad[0] = float("inf")
    elif loc == "fp16":
        model.weight1.grad[0] = float("inf")


def initialize(models, optimizers, opt_level, num_losses):
    _amp_state.allow_incoming_model_not_fp32 = True
    try:
        out = amp.initialize(
            models,
            optimizers,
            opt_level=opt_level,
            verbosity=0,
            cast_model_type=False,
            num_losses=num_losses,
        )
    finally:
        _amp_state.allow_incoming_model_not_fp32 = False
    _amp_state.loss_scalers[0]._loss_scale = 4.0
    if num_losses == 2:
        _amp_state.loss_scalers[1]._loss_scale = 16.0
    return out


def check_final(models, optimizers, reference):
    model_params = [p for m in models for p in m.parameters()]
    masters = [p for opt in optimizers for p in amp.master_params(opt)]
    for model, master, ref in zip(model_params, masters, reference, strict=True):
        assert torch.allclose(model, ref)
        assert torch.allclose(model, master.to(model.dtype))


@pytest.mark.parametrize("use_multiple_loss_scalers", [True, False])
@pytest.mark.parametrize("how_to_zero", HOW_TO_ZERO)
@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_2models2losses1optimizer(opt_level, how_to_zero, use_multiple_loss_scalers) -> None:
    def build():
        m0, m1 = MyModel(1), MyModel(2)
        opt = torch.optim.SGD(
            [{"params": m0.parameters(), "lr": 0.25}, {"params": m1.parameters(), "lr": 0.5}],
            momentum=0.125,
        )
        return m0, m1, opt

    model0, model1, optimizer = build()
    reference_grads = []
    for _ in range(2):
        optimizer.zero_grad()
        model0(X).backward()
        model1(X).backward()
        reference_grads.append(grads(model0, model1))
        optimizer.step()
    final_params = params(model0, model1)

    num_losses, loss_ids = (2, [0, 1]) if use_multiple_loss_scalers else (1, [0, 0])
    for inject_inf, loc, which_backward, _ in injections(opt_level):
        iters = 3 if inject_inf >= 0 else 2
        model0, model1, optimizer = build()
        models = [model0, model1]
        [model0, model1], optimizer = initialize(models, optimizer, opt_level, num_losses)
        unskipped = 0
        for i in range(iters):
            zero(how_to_zero, models, [optimizer])
            loss0, loss1 = model0(X), model1(X)
            with amp.scale_loss(loss0, optimizer, loss_id=loss_ids[0]) as scaled_loss:
                scaled_loss.backward()
                if i == inject_inf and which_backward == 0:
                    inject(model0, loc)
            with amp.scale_loss(loss1, optimizer, loss_id=loss_ids[1]) as scaled_loss:
                scaled_loss.backward()
                if i == inject_inf and which_backward == 1:
                    inject(model1, loc)
            if i != inject_inf:
                for param, ref in zip(
                    amp.master_params(optimizer), reference_grads[unskipped], strict=True
                ):
                    assert torch.allclose(param.grad.float(), ref.float())
                unskipped += 1
            optimizer.step()
        check_final(models, [optimizer], final_params)
        if opt_level == "O1":
            _amp_state.handle._deactivate()


@pytest.mark.parametrize("use_multiple_loss_scalers", [True, False])
@pytest.mark.parametrize("how_to_zero", HOW_TO_ZERO)
@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_3models2losses1optimizer(opt_level, how_to_zero, use_multiple_loss_scalers) -> None:
    def build():
        ms = [MyModel(1), MyModel(2), MyModel(3)]
        opt = torch.optim.SGD(
            [
                {"params": ms[0].parameters(), "lr": 0.25},
                {"params": ms[1].parameters(), "lr": 0.5},
                {"params": ms[2].parameters(), "lr": 0.125},
            ],
            momentum=0.125,
        )
        return ms, opt

    (model0, model1, model2), optimizer = build()
    reference_grads = []
    for _ in range(2):
        optimizer.zero_grad()
        (model0(X) + model2(X)).backward()
        (model1(X) + model2(X)).backward()
        reference_grads.append(grads(model0, model1, model2))
        optimizer.step()
    final_params = params(model0, model1, model2)

    num_losses, loss_ids = (2, [0, 1]) if use_multiple_loss_scalers else (1, [0, 0])
    for inject_inf, loc, which_backward, which_model in injections(
        opt_level, which_models_for={0: (0, 2), 1: (1, 2)}
    ):
        iters = 3 if inject_inf >= 0 else 2
        models, optimizer = build()
        models, optimizer = initialize(models, optimizer, opt_level, num_losses)
        model0, model1, model2 = models
        unskipped = 0
        for i in range(iters):
            zero(how_to_zero, models, [optimizer])
            loss0 = model0(X) + model2(X)
            loss1 = model1(X) + model2(X)
            with amp.scale_loss(loss0, optimizer, loss_id=loss_ids[0]) as scaled_loss:
                scaled_loss.backward()
                if i == inject_inf and which_backward == 0:
                    inject(models[which_model], loc)
            with amp.scale_loss(loss1, optimizer, loss_id=loss_ids[1]) as scaled_loss:
                scaled_loss.backward()
                if i == inject_inf and which_backward == 1:
                    inject(models[which_model], loc)
            if i != inject_inf:
                for param, ref in zip(
                    amp.master_params(optimizer), reference_grads[unskipped], strict=True
                ):
                    assert torch.allclose(param.grad.float(), ref.float())
                unskipped += 1
            optimizer.step()
        check_final(models, [optimizer], final_params)
        if opt_level == "O1":
            _amp_state.handle._deactivate()


@pytest.mark.parametrize("use_multiple_loss_scalers", [True, False])
@pytest.mark.parametrize("how_to_zero", HOW_TO_ZERO)
@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_2models2losses2optimizers(opt_level, how_to_zero, use_multiple_loss_scalers) -> None:
    def build():
        m0, m1 = MyModel(1), MyModel(2)
        opt0 = torch.optim.SGD([{"params": m0.parameters(), "lr": 0.25}], momentum=0.125)
        opt1 = torch.optim.SGD([{"params": m1.parameters(), "lr": 0.5}], momentum=0.25)
        return m0, m1, opt0, opt1

    def what_got_skipped(which_iter, which_backward):
        if which_iter in (0, 1) and which_backward in (0, 1):
            return 1 + 2 * which_iter + which_backward
        return 0

    reference_grads: list[list] = [[], [], [], [], []]
    final_params: list = [None] * 5
    model0, model1, optimizer0, optimizer1 = build()
    for _ in range(2):
        optimizer0.zero_grad()
        optimizer1.zero_grad()
        model0(X).backward()
        model1(X).backward()
        reference_grads[0].append(grads(model0, model1))
        optimizer0.step()
        optimizer1.step()
    final_params[0] = params(model0, model1)
    for which_iter in (0, 1):
        for which_backward in (0, 1):
            model0, model1, optimizer0, optimizer1 = build()
            for i in range(3):
                optimizer0.zero_grad()
                optimizer1.zero_grad()
                model0(X).backward()
                model1(X).backward()
                if i != which_iter:
                    reference_grads[what_got_skipped(which_iter, which_backward)].append(
                        grads(model0, model1)
                    )
                if i == which_iter:  # the optimizer the overflowing loss reached skips
                    (optimizer1 if which_backward == 0 else optimizer0).step()
                else:
                    optimizer0.step()
                    optimizer1.step()
            final_params[what_got_skipped(which_iter, which_backward)] = params(model0, model1)

    num_losses, loss_ids = (2, [0, 1]) if use_multiple_loss_scalers else (1, [0, 0])
    for inject_inf, loc, which_backward, _ in injections(opt_level):
        iters = 3 if inject_inf >= 0 else 2
        model0, model1, optimizer0, optimizer1 = build()
        models = [model0, model1]
        [model0, model1], [optimizer0, optimizer1] = initialize(
            models, [optimizer0, optimizer1], opt_level, num_losses
        )
        skipped = what_got_skipped(inject_inf, which_backward)
        unskipped = 0
        for i in range(iters):
            zero(how_to_zero, models, [optimizer0, optimizer1])
            loss0, loss1 = model0(X), model1(X)
            with amp.scale_loss(loss0, optimizer0, loss_id=loss_ids[0]) as scaled_loss:
                scaled_loss.backward()
                if i == inject_inf and which_backward == 0:
                    inject(model0, loc)
            with amp.scale_loss(loss1, optimizer1, loss_id=loss_ids[1]) as scaled_loss:
                scaled_loss.backward()
                if i == inject_inf and which_backward == 1:
                    inject(model1, loc)
            if i != inject_inf:
                masters = list(amp.master_params(optimizer0)) + list(amp.master_params(optimizer1))
                for param, ref in zip(masters, reference_grads[skipped][unskipped], strict=True):
                    assert torch.allclose(param.grad.float(), ref.float())
                unskipped += 1
            optimizer0.step()
            optimizer1.step()
        check_final(models, [optimizer0, optimizer1], final_params[skipped])
        if opt_level == "O1":
            _amp_state.handle._deactivate()


@pytest.mark.parametrize("use_multiple_loss_scalers", [True, False])
@pytest.mark.parametrize("how_to_zero", HOW_TO_ZERO)
@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_3models2losses2optimizers(opt_level, how_to_zero, use_multiple_loss_scalers) -> None:
    def build():
        ms = [MyModel(1), MyModel(2), MyModel(3)]
        opt0 = torch.optim.SGD(
            [{"params": ms[0].parameters(), "lr": 0.25}, {"params": ms[1].parameters(), "lr": 1.0}],
            momentum=0.5,
        )
        opt1 = torch.optim.SGD([{"params": ms[2].parameters(), "lr": 0.5}], momentum=0.25)
        return ms, opt0, opt1

    def what_got_skipped(which_iter, which_backward, which_model):
        table = {(0, 0): 1, (0, 1): 2, (1, 2): 3, (1, 1): 4}  # (which_backward, which_model)
        if which_iter in (0, 1) and (which_backward, which_model) in table:
            return table[(which_backward, which_model)] + 4 * which_iter
        return 0

    def losses(m0, m1, m2):
        return m0(X) + m1(X), m2(X) + m1(X)

    reference_grads: list[list] = [[] for _ in range(9)]
    final_params: list = [None] * 9
    (model0, model1, model2), optimizer0, optimizer1 = build()
    for _ in range(2):
        optimizer0.zero_grad()
        optimizer1.zero_grad()
        for loss in losses(model0, model1, model2):
            loss.backward()
        reference_grads[0].append(grads(model0, model1))  # Apex's: model0's and model1's only
        optimizer0.step()
        optimizer1.step()
    final_params[0] = params(model0, model1, model2)
    for which_iter in (0, 1):
        for which_backward, which_models in ((0, (0, 1)), (1, (2, 1))):
            for which_model in which_models:
                (model0, model1, model2), optimizer0, optimizer1 = build()
                skipped = what_got_skipped(which_iter, which_backward, which_model)
                for i in range(3):
                    optimizer0.zero_grad()
                    optimizer1.zero_grad()
                    for loss in losses(model0, model1, model2):
                        loss.backward()
                    if i != which_iter:
                        reference_grads[skipped].append(grads(model0, model1))
                    if i == which_iter:
                        if which_backward == 0:  # loss0 reaches optimizer0 only
                            optimizer1.step()
                        # loss1 reaches both optimizers: both skip
                    else:
                        optimizer0.step()
                        optimizer1.step()
                final_params[skipped] = params(model0, model1, model2)

    num_losses, loss_ids = (2, [0, 1]) if use_multiple_loss_scalers else (1, [0, 0])
    for inject_inf, loc, which_backward, which_model in injections(
        opt_level, which_models_for={0: (0, 1), 1: (2, 1)}
    ):
        iters = 3 if inject_inf >= 0 else 2
        models, optimizer0, optimizer1 = build()
        models, [optimizer0, optimizer1] = initialize(
            models, [optimizer0, optimizer1], opt_level, num_losses
        )
        model0, model1, model2 = models
        skipped = what_got_skipped(inject_inf, which_backward, which_model)
        unskipped = 0
        for i in range(iters):
            zero(how_to_zero, models, [optimizer0, optimizer1])
            loss0, loss1 = losses(model0, model1, model2)
            with amp.scale_loss(loss0, optimizer0, loss_id=loss_ids[0]) as scaled_loss:
                scaled_loss.backward()
                if i == inject_inf and which_backward == 0:
                    inject(models[which_model], loc)
            with amp.scale_loss(
                loss1, [optimizer0, optimizer1], loss_id=loss_ids[1]
            ) as scaled_loss:
                scaled_loss.backward()
                if i == inject_inf and which_backward == 1:
                    inject(models[which_model], loc)
            if i != inject_inf:
                # Apex zipped all masters with model0's and model1's reference grads: the
                # comparison covers optimizer0's masters (model0 and model1)
                masters = list(amp.master_params(optimizer0))
                for param, ref in zip(masters, reference_grads[skipped][unskipped], strict=True):
                    assert torch.allclose(param.grad.float(), ref.float())
                unskipped += 1
            optimizer0.step()
            optimizer1.step()
        check_final(models, [optimizer0, optimizer1], final_params[skipped])
        if opt_level == "O1":
            _amp_state.handle._deactivate()
