"""Apex's `amp` on mixprec's core: initialize, scale_loss, master_params, state_dict.

    from mixprec.apex import amp

    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    for x, y in data:
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()

Checkpoints. Apex's O2 rebuilt its fp32 masters from the fp16 model on resume, so a resumed
run drifted from an uninterrupted one. Here the optimizer `initialize` returns carries the fp32
masters in its state_dict(), so saving and loading these three resumes bit for bit:

    torch.save({"model": model.state_dict(),        # fp32 tensors, as Apex's O2 saved them
                "optimizer": optimizer.state_dict(),  # torch's layout + fp32 masters + scaler 0
                "amp": amp.state_dict()}, path)       # every loss scaler
    # resume: build the model and optimizer as before, then
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    checkpoint = torch.load(path)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])  # after the model: masters win
    amp.load_state_dict(checkpoint["amp"])

The optimizer checkpoint is torch's {'state', 'param_groups'} with mixprec's additions beside
it, so Apex's and plain torch optimizers' checkpoints load here (masters then rebuilt from the
model, as Apex did), checkpoints cross opt levels (O2's masters land on O1's fp32 params), and
Apex's other order (optimizer.load_state_dict before initialize) works too, with the masters
built from the cast model.

What initialize does, as Apex does: models are cast in place (O2/O3: low-precision weights,
norm layers fp32 unless keep_batchnorm_fp32=False) and keep their identity; their instance
`forward` is patched (inputs cast to the model dtype, O1's forward run under autocast, outputs
cast to cast_model_outputs, fp32 by default for a cast model). Where Apex patched the user's
optimizer object, mixprec returns an `PerLossOptimizer` wrapping it (a torch.optim.Optimizer
subclass sharing its param_groups, so LR schedulers built on either keep working).

Scaling: one LossScaler per loss_id (num_losses). On leaving `scale_loss` (unless
delay_unscale) the grads that backward just produced are unscaled with that loss's scale and
checked, and that scaler alone is updated by the result; an optimizer skips its next step if
any loss that reached it since its last step overflowed. The overflow message ("Gradient
overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0") is a warning on the
"mixprec" logger, once per overflowing loss, on rank 0 only; verbosity=0 silences it.

Optimizers: torch optimizers or wrappers with step, zero_grad, param_groups and state_dict
(Apex's LARC). A second initialize with fresh objects leaves the first call's optimizers
working with their own loss scalers; amp.state_dict() and `_amp_state` follow the latest call.
A model that already holds fp16 params needs `amp._amp_state.allow_incoming_model_not_fp32 =
True`, as in Apex; cast_model_type=False leaves its dtypes alone.

Apex's older handle API, `handle = amp.init(...)` (O1 casts until `handle._deactivate()`,
`handle.scale_loss`, `handle.wrap_optimizer`), is in mixprec.apex.handle. The code of the rest
is in mixprec.apex.amp.frontend (Apex's module path for it), which the handle API builds on.

Gradients with master weights (O2, or master_weights=True), as in Apex: after `scale_loss`
exits, each fp16 model param keeps the grad of that backward, still multiplied by the loss
scale; its fp32 master holds the unscaled sum of every loss since the last step, and that is
what the step applies (clip `amp.master_params(optimizer)`). `optimizer.zero_grad()` zeroes the
model grads in place and drops the masters' (zero_grad(set_to_none=True) drops both).

Differences from Apex, each deliberate: errors raise ValueError/TypeError (Apex: RuntimeError,
unless hard_override); O3's static scale of 1 still checks for inf/nan and skips (Apex stepped
blindly); a step with fp16 model grads the masters never received (backward called on an
unscaled loss) raises instead of silently ignoring them, and fp16 model grads changed after
`scale_loss` (torch's clip_grad_norm_ on model.parameters()) are warned about once, at WARNING,
where Apex ignored the change silently; gradients the step applies that were written after
their check at `scale_loss` (a user's edit, an outside clip) are checked again at the step, and
an inf/nan there skips it on every rank (Apex applied them).
"""

from mixprec.apex.amp._amp_state import _amp_state, master_params
from mixprec.apex.amp.frontend import (
    PARALLEL_WRAPPERS,
    Properties,
    disable_casts,
    initialize,
    load_state_dict,
    scale_loss,
    state_dict,
)
from mixprec.apex.functions import (  # Apex's amp namespace holds these too
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from mixprec.apex.handle import init

__all__ = [
    "PARALLEL_WRAPPERS",
    "Properties",
    "_amp_state",
    "disable_casts",
    "float_function",
    "half_function",
    "init",
    "initialize",
    "load_state_dict",
    "master_params",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "scale_loss",
    "state_dict",
]
