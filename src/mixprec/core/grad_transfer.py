"""The one gradient-transfer component: low-precision grads -> fp32 master grads, and back.

MixedPrecisionOptimizer holds one GradTransfer over its inner optimizer. It pairs each
low-precision param with its fp32 master (the master sits in the inner optimizer's
param_groups where the lp param was), moves a step's lp grads onto the masters, copies the
updated masters back into the params, and keeps the gradients a step leaves in .grad for a
backward that comes before zero_grad() (the g1 + g2 carry, see Carry): it is the carry's one
owner. A reducer that hands the step grads of its own (ZeRO's owners' shares) says so with
hand(), as data (Handed: the params, the grads, the divisor of the next reduction, how a grad is
shaped like its param), and the carry gives those back (give_back); no other class keeps them.

How the grads move is its way: at step, as each backward accumulates (Accumulate) or per
backward (PerBackward). A reducer slot follows the way (GradReducer: NoReduce by default; the
parallel layer supplies the data-parallel mean, fp8 included, and ZeRO's buckets, which reduce
the lp grads and hand each owner its share in place of the move), so a parallelism reduces the
grads without overriding the optimizer.

Everything per-param that does not change between steps (which params are masters, which
the inner optimizer steps itself, where they live) is read once per param_groups layout
(Layout) instead of being rebuilt every step.
"""

from __future__ import annotations

import functools
import operator
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from mixprec.core.clip import local_shards
from mixprec.core.policy import LOW_DTYPES as LOW_DTYPE_NAMES
from mixprec.core.scaling import unscale_and_check_

if TYPE_CHECKING:
    from mixprec.core.scaling import LossScaler

LOW_DTYPES = tuple(dict.fromkeys(LOW_DTYPE_NAMES.values()))
"""float16, bfloat16: the dtypes that get an fp32 master."""
_PARAMS = operator.itemgetter("params")


@dataclass(frozen=True)
class Layout:
    """What an optimizer's held params are, read once per param_groups layout."""

    probe: torch.Tensor | None
    """The first held param: its .device (which follows .to()) says where the step runs."""
    numel: int
    """Elements of every held param: a bound on a step's gradients."""
    uniform: bool
    """Every held param on the probe's device with the probe's dtype (grads alike)."""
    sharded: bool
    """Some held param is a DTensor: its grad is checked through its local shard."""
    held: tuple[torch.Tensor, ...] = ()
    """Every param the inner optimizer steps, in param_groups order (masters included)."""
    own: tuple[torch.Tensor, ...] = ()
    """The held params that are not fp32 masters: the inner optimizer steps them directly."""

    @staticmethod
    def of(params: list[torch.Tensor], master_ids: frozenset[int] = frozenset()) -> Layout:
        probe = params[0] if params else None
        return Layout(
            probe=probe,
            numel=sum(p.numel() for p in params),
            uniform=probe is not None
            and all(p.device == probe.device and p.dtype == probe.dtype for p in params),
            sharded=any(hasattr(p, "to_local") for p in params),
            held=tuple(params),
            own=tuple(p for p in params if id(p) not in master_ids),
        )


@dataclass(frozen=True)
class Carry:
    """The gradients a step leaves in .grad, for a backward that comes before zero_grad().

    torch's contract (DDP's, Colossal's): a step leaves its gradients in .grad, so backward +
    step twice with no zero_grad() steps on g1 + g2 the second time. The model's lp grads stay
    as backward left them (scaled, in lp), own params' grads as the step used them (unscaled,
    clipped, in fp32, or as read by the fused step); before the next backward adds to them, each
    is multiplied by its factor and by that backward's scale, so the next unscale gives g1 + g2
    (exact for power-of-two scales; the lp sum rounds as micro-batch accumulation does).
    model.zero_grad() or the optimizer's drops them as in torch; a grad set by hand in their
    place is taken as it is (each kept grad is known by a weak reference).
    """

    lp_grads: list[weakref.ref[torch.Tensor]]
    """The lp grads kept."""
    own_grads: list[weakref.ref[torch.Tensor]]
    """The own params' grads kept."""
    lp_factor: torch.Tensor | None
    """What unscales the kept lp grads (the inverse scale they carry, times a fused clip; None:
    they are unscaled already)."""
    own_factor: torch.Tensor | None
    """The same for own params' grads (None: unscaled and clipped in place already)."""


@dataclass(frozen=True)
class Handed:
    """Grads a reducer handed the step in place of the params' own .grad, for the carry to give
    back (GradTransfer.hand, give_back). ZeRO's buckets: each owner's share of the group's mean
    (in its master's fp32 grad, or as its fp32 param's grad), no grad on the params other ranks
    own, no lp grad left in .grad."""

    params: list[torch.Tensor]
    """The model params the grads go back to."""
    grads: list[torch.Tensor]
    """What the step ran on, one per param (unscaled and clipped in place by then; a DTensor's
    local shard)."""
    divisor: int
    """What the next reduction divides the sum of the ranks' grads by (ZeRO: the world size; the
    other ranks hold none of these params' grads), so the grad given back is multiplied by it."""
    shape: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(param, the values given back) -> the .grad to set (ZeRO: a DTensor laid out as its param
    around its local shard; a plain param's values as they are)."""


class GradReducer(Protocol):
    """The reducer slot after the transfer's way: what a step's gradients go through, once per
    step, before they are unscaled and checked, so that every rank sharing them steps on the
    same values. NoReduce by default; mixprec.parallel supplies the others."""

    def reduce_(self, transfer: GradTransfer, move: Callable[[], None]) -> None:
        """Reduce this step's grads in place around move() (the way's move at step): after it,
        where the fp32 grads the masters then hold are reduced; or in its place, where the lp
        grads are reduced first and the reducer hands each master its share itself."""
        ...

    def zero_grad(self, set_to_none: bool) -> None:
        """zero_grad(): drop what the reducer holds of the grads being cleared."""
        ...


class NoReduce:
    """Nothing to reduce: one process, or the grads arrive reduced (DDP's backward)."""

    def reduce_(self, transfer: GradTransfer, move: Callable[[], None]) -> None:
        move()

    def zero_grad(self, set_to_none: bool) -> None:
        """Nothing held."""


class GradTransfer:
    """lp params, their fp32 masters, and the gradients between them, for one inner optimizer.

    Args:
        optim: the inner torch optimizer; its param_groups are read (and get the masters).
    """

    def __init__(self, optim: torch.optim.Optimizer) -> None:
        self.optim = optim
        # (lp param, fp32 master) pairs; the master sits in param_groups where lp was.
        self.lp_params: list[torch.Tensor] = []
        self.hp_masters: list[torch.Tensor] = []
        self._layout_key: tuple[Any, ...] | None = None  # see layout()
        self._layout_lists: tuple[list[torch.Tensor], ...] = ()  # held: their ids stay theirs
        self._pinned: Layout | None = None  # see pin_layout()
        self._layout_value = Layout.of([])
        self.carry: Carry | None = None  # the last step's gradients, left in .grad: see Carry
        self.handed: Handed | None = None  # the grads a reducer handed this step: see hand()
        self.unscaled_version = -1  # a master grad's version once unscaled: see keep()
        self.inv_used: torch.Tensor | None = None  # the inverse scale the last unscale used
        self.way: Accumulate | PerBackward | None = None
        """How grads reach the masters: None at step (to_masters copies them), Accumulate as
        each backward accumulates, PerBackward at each backward's end (see accumulate_as_backward,
        per_backward)."""
        self.reducer: GradReducer = NoReduce()
        """What the grads go through after the way, once per step (see reduce_with)."""
        self.carry_masters = False
        """The masters' grads are what backward sums into (a pipeline stage's hook frees each lp
        grad into its master's): the carry is then over every held param, masters included."""

    # ----- pairing -----
    def masters_for(self, params: list[torch.Tensor], use_masters: bool) -> list[torch.Tensor]:
        """params with each low-precision one replaced by a new fp32 master (use_masters), the
        optimizer state it already had moved onto the master."""
        out = []
        state = self.optim.state
        for p in params:
            if use_masters and p.dtype in LOW_DTYPES:
                master = p.detach().clone().float()
                master.requires_grad_(True)
                if p in state:  # keep any state the optimizer already had, as the master's:
                    # state shaped and typed like the lp param (Adagrad's `sum`, built at
                    # construction) becomes fp32 as the master, as torch makes it like its param
                    state[master] = {
                        k: v.float() if _like(v, p) else v for k, v in state.pop(p).items()
                    }
                self.lp_params.append(p)
                self.hp_masters.append(master)
                out.append(master)
            else:
                out.append(p)
        return out

    def master_to_lp(self) -> dict[int, torch.Tensor]:
        return {id(hp): lp for lp, hp in zip(self.lp_params, self.hp_masters, strict=True)}

    def layout(self) -> Layout:
        """What the held params are, cached per param_groups layout (the groups' lists and
        lengths, and the masters') and looked at again when a group is added, replaced or
        resized: the walk over every param is not paid per step. Within pin_layout() (a step,
        which changes no group) the layout is looked at once, not at each of the step's ~12
        reads (~3 us each: 1 % of a tiny model's step): the transfer's own reads take the pinned
        layout without calling this."""
        if self._pinned is not None:
            return self._pinned
        lists = tuple(map(_PARAMS, self.optim.param_groups))  # C calls only: no Python frame
        key = (tuple(map(id, lists)), tuple(map(len, lists)), len(self.hp_masters))
        if self._layout_key != key:
            master_ids = frozenset(id(m) for m in self.hp_masters)
            self._layout_value = Layout.of([p for ps in lists for p in ps], master_ids)
            self._layout_key = key
            self._layout_lists = lists
        return self._layout_value

    def pin_layout(self) -> None:
        """Read the layout once for what follows, until unpin_layout() (see layout())."""
        self._pinned = None
        self._pinned = self.layout()

    def unpin_layout(self) -> None:
        self._pinned = None

    def device(self) -> torch.device:
        """Where the held params live: the first one's device (cached with the layout)."""
        probe = (self._pinned or self.layout()).probe
        return probe.device if probe is not None else torch.device("cpu")

    def local(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """local_shards(tensors) of held params (or their masters, lp params, grads, which shard
        alike), skipping the walk when no held param is sharded (the cached layout says so)."""
        return local_shards(tensors) if (self._pinned or self.layout()).sharded else tensors

    # ----- the gradients -----
    def held_grads(self) -> list[torch.Tensor]:
        """Gradients of everything the wrapped optimizer steps (fp32 masters and fp32 params).

        Sharded (DTensor) grads are checked through their local shard: the same storage, and
        the overflow flag is reduced over the group afterwards, so the check stays exact.
        """
        grads = [p.grad for p in (self._pinned or self.layout()).held if p.grad is not None]
        return self.local(grads)

    def step_grads(self) -> list[torch.Tensor]:
        """This step's grads as backward left them: lp grads, and own params' own."""
        grads = [lp.grad for lp in self.lp_params if lp.grad is not None]
        own = (self._pinned or self.layout()).own
        return grads + [p.grad for p in own if p.grad is not None]

    def accumulate_as_backward(
        self, *, reuse_buffers: bool, on_add: Callable[[], None] | None = None
    ) -> Accumulate:
        """Move the grads as each backward accumulates from now on (see Accumulate)."""
        self.way = Accumulate(self, reuse_buffers=reuse_buffers, on_add=on_add)
        return self.way

    def per_backward(self) -> PerBackward:
        """Move the grads at the end of each backward, per loss, from now on (see PerBackward)."""
        self.way = PerBackward(self)
        return self.way

    def reduce_with(self, reducer: GradReducer) -> GradReducer:
        """Reduce the grads by reducer after the way from now on (see GradReducer)."""
        self.reducer = reducer
        return reducer

    def to_masters(self, *, free_lp: bool) -> None:
        """This step's grads onto the masters by self.way, through self.reducer (the caller runs
        it once per step: see MixedPrecisionOptimizer.grads_to_masters)."""
        self.handed = None
        self.reducer.reduce_(self, functools.partial(self._move, free_lp=free_lp))

    def hand(self, handed: Handed) -> None:
        """A reducer's reduce_ says it handed the step handed.grads in place of the params'
        .grad: the carry gives those back after the update (give_back), not the .grad left."""
        self.handed = handed

    def _move(self, *, free_lp: bool) -> None:
        """The way at step: each lp grad, as backward left it, into its master's fp32 grad
        (free_lp: the lp grad is freed, else it stays in .grad: see Carry); Accumulate.at_step;
        nothing per backward (done at each backward)."""
        if isinstance(self.way, Accumulate):
            self.way.at_step()
            return
        if isinstance(self.way, PerBackward):
            return
        lp_grads, hp_grads = [], []
        for lp, hp in zip(self.lp_params, self.hp_masters, strict=True):
            if lp.grad is None:
                hp.grad = None  # this param took no part: no stale gradient may be applied
                continue
            if hp.grad is None:
                hp.grad = torch.empty_like(hp)
            lp_grads.append(lp.grad)
            hp_grads.append(hp.grad)
            if free_lp:
                lp.grad = None  # the lp gradient lives only from backward to step
        if hp_grads:
            torch._foreach_copy_(self.local(hp_grads), self.local(lp_grads))

    def unscale_and_check(self, scaler: LossScaler) -> tuple[torch.Tensor, bool]:
        """Unscale the held grads in place (by scaler's inverse scale, kept in inv_used) and
        check them: (this rank's overflow flag, whether there was any grad)."""
        found_inf = scaler.scale_tensor.new_zeros(1)  # fp32, on the scale's device
        inv_scale = self.inv_used = scaler.inv_scale()
        grads = self.held_grads()
        if grads:
            layout = self._pinned or self.layout()
            one_bucket = layout.uniform and layout.probe.device == found_inf.device
            unscale_and_check_(grads, inv_scale, found_inf, one_bucket=one_bucket)
        return found_inf, bool(grads)

    def held_names(self, model: torch.nn.Module) -> dict[int, str]:
        """id(param as the inner optimizer holds it: the master of an lp param) -> its name."""
        lp_to_master = {id(lp): hp for lp, hp in zip(self.lp_params, self.hp_masters, strict=True)}
        return {id(lp_to_master.get(id(p), p)): name for name, p in model.named_parameters()}

    def nonfinite(self, names: dict[int, str]) -> list[str]:
        """Names (from held_names; else group/index) of the held params whose current gradient
        holds inf/nan (a fused step reads the lp grad: the master then has none)."""
        bad = []
        master_to_lp = self.master_to_lp()
        for g, group in enumerate(self.optim.param_groups):
            for i, p in enumerate(group["params"]):
                lp = master_to_lp.get(id(p))
                grad = lp.grad if p.grad is None and lp is not None else p.grad
                if grad is not None and not bool(torch.isfinite(grad).all()):
                    bad.append(names.get(id(p), f"param_groups[{g}][{i}] {tuple(p.shape)}"))
        return bad

    def masters_to_params(self) -> None:
        if self.hp_masters:
            torch._foreach_copy_(self.local(self.lp_params), self.local(self.hp_masters))

    def held_grad_version(self) -> int:
        """The version counter of the first held grad (a host int: no sync), -1 without one.
        An in-place write (a clip) after the unscale bumps it: see keep()."""
        for hp in self.hp_masters:
            if hp.grad is not None:
                return hp.grad._version
        return -1

    def note_unscaled(self, version: int | None = None) -> None:
        """The held grads were unscaled (by inv_used); version: the held grads' version then
        (None: read it now; -2: the lp grads hold another scale and are never kept as they are)."""
        self.unscaled_version = self.held_grad_version() if version is None else version

    def free_master_grads(self) -> None:
        for hp in self.hp_masters:
            hp.grad = None

    def zero_grad(self, set_to_none: bool) -> None:
        """torch's zero_grad over the lp params and own params (masters' grads are overwritten
        each step, or freed: zeroing them is wasted work); the carry, the reducer's share and
        Accumulate's sums are dropped with them."""
        self.reducer.zero_grad(set_to_none)
        self.handed = None
        if isinstance(self.way, Accumulate):
            self.way.reset()
        for p in (*self.lp_params, *self.layout().own):
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
        self.carry = None

    # ----- the g1 + g2 carry (torch's contract: a step leaves its grads in .grad) -----
    def keep(
        self, scaler: LossScaler, *, fused: bool = False, factor: torch.Tensor | None = None
    ) -> None:
        """Leave this step's gradients where a backward before zero_grad() adds to them (see
        Carry). fused: the lp and own grads were read, not unscaled: factor (None: 1) unscales
        and clips them. Unfused, the lp grads are kept as backward left them, unless the
        masters' grads were written after the unscale (a clip): then the lp grads take the
        masters' values (times the next scale: fp16 keeps its range), one pass. Where a
        reducer handed the step its own grads (hand()), those are what is kept: give_back()
        puts them into .grad once the update has read them."""
        if self.handed is not None:
            self.carry = None
            return
        unit = scaler.is_unit
        if fused:
            lp_factor, own_factor = factor, factor
        elif self.held_grad_version() == self.unscaled_version:
            lp_factor, own_factor = None if unit else self.inv_used, None
        else:
            pairs = [
                (lp.grad, hp.grad)
                for lp, hp in zip(self.lp_params, self.hp_masters, strict=True)
                if lp.grad is not None and hp.grad is not None
            ]
            if pairs:
                lp_grads = self.local([lp for lp, _ in pairs])
                hp_grads = self.local([hp for _, hp in pairs])
                if not unit:
                    hp_grads = torch._foreach_mul(hp_grads, scaler.scale_tensor.reshape(()))
                torch._foreach_copy_(lp_grads, hp_grads)
            lp_factor, own_factor = None if unit else scaler.inv_scale(), None
        if unit and lp_factor is None and own_factor is None:
            return  # kept as they are: nothing to bring to any scale
        self.carry = Carry(
            lp_grads=[weakref.ref(lp.grad) for lp in self.lp_params if lp.grad is not None],
            own_grads=[weakref.ref(p.grad) for p in self._carried_own() if p.grad is not None],
            lp_factor=lp_factor,
            own_factor=own_factor,
        )
        if unit:  # no scaled backward need come first (plain loss.backward()): apply it now
            self.rescale_carried(scaler)

    def give_back(self, scaler: LossScaler) -> None:
        """After the update (the step has read its grads): the grads a reducer handed the step
        (see Handed) become their params' .grad, times the next loss scale (the next backward's
        grads come scaled by it) and times handed.divisor (the next reduction divides the sum by
        it), in the param's dtype; once. The next reduction then gives mean(g1) + mean(g2)."""
        handed, self.handed = self.handed, None
        if handed is None or not handed.grads:
            return
        factor = scaler.scale_tensor * handed.divisor  # device tensors: no sync
        for p, grad in zip(handed.params, handed.grads, strict=True):
            p.grad = handed.shape(p, (grad * factor).to(p.dtype))

    def _carried_own(self) -> tuple[torch.Tensor, ...]:
        """The params whose own grads a step leaves (see carry_masters)."""
        layout = self._pinned or self.layout()
        return layout.held if self.carry_masters else layout.own

    def rescale_carried(self, scaler: LossScaler) -> None:
        """Bring the gradients the last step left to the current loss scale, before a backward
        adds to them or a step reads them (device ops, no sync), once."""
        carry, self.carry = self.carry, None
        if carry is None:
            return
        scale = None if scaler.is_unit else scaler.scale_tensor.reshape(())
        for kept, params, factor in (
            (carry.lp_grads, self.lp_params, carry.lp_factor),
            (carry.own_grads, self._carried_own(), carry.own_factor),
        ):
            if factor is None and scale is None:
                continue
            held = {id(p.grad) for p in params if p.grad is not None}
            grads = [g for ref in kept if (g := ref()) is not None and id(g) in held]
            if not grads:
                continue
            if factor is None:
                times = scale
            else:
                factor = factor.reshape(())
                times = factor if scale is None else scale * factor
            torch._foreach_mul_(self.local(grads), times)


class Accumulate:
    """The transfer as each backward accumulates: a post-accumulate-grad hook on each lp param
    sums its grad into its master's fp32 grad and frees it (micro-batches sum in fp32, no lp
    rounding between them; the lp grad lives only inside backward). Paddle's master-weight
    optimizer and a pipeline stage use it.

    Args:
        reuse_buffers: a master grad not summed into since reset() (zero_grad) is overwritten in
            place (its buffer, kept between steps, is reused: no page faults), and one still not
            summed into at the step is dropped (no stale gradient applied). False: a master grad
            present is added to (it is None after zero_grad, or zeroed).
        on_add: called after each grad is moved (the pipeline marks its step's grads as on the
            masters).
    """

    def __init__(
        self,
        transfer: GradTransfer,
        *,
        reuse_buffers: bool,
        on_add: Callable[[], None] | None = None,
    ) -> None:
        self.transfer = transfer
        self.reuse_buffers = reuse_buffers
        self.on_add = on_add
        self.fresh: set[int] = set()  # ids of masters whose grad holds a sum to add to

    def hook(self, lp: torch.Tensor, hp: torch.Tensor) -> Any:
        """Install the hook that moves lp's grads into hp's; returns its handle."""
        return lp.register_post_accumulate_grad_hook(functools.partial(self.add, hp))

    def add(self, hp: torch.Tensor, lp: torch.Tensor) -> None:
        """lp's grad (when it has one) summed into hp's fp32 grad, then freed."""
        grad = lp.grad
        if grad is None:  # another hook already took it
            return
        if hp.grad is not None and (not self.reuse_buffers or id(hp) in self.fresh):
            hp.grad.add_(grad)  # fp32 += lp: the add upcasts exactly
        elif hp.grad is not None:
            hp.grad.copy_(grad)  # reuse the buffer kept between steps
        else:
            hp.grad = grad.float()
        self.fresh.add(id(hp))
        lp.grad = None
        if self.on_add is not None:
            self.on_add()

    def at_step(self) -> None:
        """At the step: an lp grad still present was not produced by backward (set by hand):
        fold it in rather than lose it; with reuse_buffers, drop master grads not summed into
        since zero_grad (no stale gradient may be applied)."""
        transfer = self.transfer
        for lp, hp in zip(transfer.lp_params, transfer.hp_masters, strict=True):
            self.add(hp, lp)
        if self.reuse_buffers:
            for hp in transfer.hp_masters:
                if id(hp) not in self.fresh:
                    hp.grad = None

    def reset(self) -> None:
        """zero_grad(): the sums are discarded with the grads."""
        self.fresh.clear()


class PerBackward:
    """The transfer per backward (Apex's per-loss stash): the grads present before a backward
    (already unscaled) are set aside, the backward's new grads are unscaled and checked on their
    own by that loss's scaler, copied to fp32 and added to the masters' grads, and the stash is
    added back. The lp params keep their last backward's grads, still scaled (as Apex)."""

    def __init__(self, transfer: GradTransfer) -> None:
        self.transfer = transfer
        # (own param, its grad before this backward): grads that are already unscaled.
        self.stash: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.stashed = False

    def begin(self) -> None:
        """Set aside the unscaled grads so the coming backward's grads can be unscaled alone."""
        transfer = self.transfer
        for lp in transfer.lp_params:
            lp.grad = None  # Apex: the model grads hold the last backward's grads only
        self.stash = []
        for p in transfer.layout().own:
            self.stash.append((p, p.grad))
            p.grad = None
        self.stashed = True

    def add_unscaled(self, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        """Unscale and check (raising found_inf) the grads since begin(), then add them to the
        earlier ones: the lp grads' fp32 copies to the masters', the own grads to the stash."""
        transfer = self.transfer
        hp_targets, new_grads = [], []
        for lp, hp in zip(transfer.lp_params, transfer.hp_masters, strict=True):
            if lp.grad is not None:
                hp_targets.append(hp)
                new_grads.append(lp.grad.float())  # the lp->fp32 copy Apex makes before unscaling
        own_new = [p.grad for p, _ in self.stash if p.grad is not None]
        if new_grads or own_new:
            unscale_and_check_(new_grads + own_new, inv_scale, found_inf)
        for hp, grad in zip(hp_targets, new_grads, strict=True):
            hp.grad = grad if hp.grad is None else hp.grad.add_(grad)
        for p, old in self.stash:
            if old is not None:
                p.grad = old if p.grad is None else p.grad.add_(old)
        self.forget()

    def forget(self) -> None:
        self.stash = []
        self.stashed = False


def _like(value: Any, param: torch.Tensor) -> bool:
    """value is a tensor of param's shape and dtype (per-element optimizer state)."""
    return (
        isinstance(value, torch.Tensor)
        and value.dtype == param.dtype
        and value.shape == param.shape
    )
