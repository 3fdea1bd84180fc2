"""Gradient communication: fp8_communication (DDP, ZeRO, the hybrid plugin's data-parallel
group) and ZeRO's overlap_communication, on 2 real gloo ranks.

Bytes on the wire are counted, not modelled: /proc/self/io's wchar counts every byte this
process hands to write()/writev(), gloo's socket sends included (nothing else writes while a
collective runs here).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_utils import assert_same_on_every_rank, spawn
from tolerances import EXACT
from torch import nn

from mixprec.booster import Booster
from mixprec.booster.plugin import (
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)
from mixprec.parallel.comm import (
    fp8_all_reduce,
    fp8_ddp_comm_hook,
    fp8_reduce_scatter,
    to_fp8_comm_dtype,
)

WIO = Path("/proc/self/io")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_BITS = {E4M3: (3, -6), E5M2: (2, -14)}  # mantissa bits, least normal exponent
FP32_SUM = 2**-20  # fp32 sums of a few terms, relative to the sum of |terms|: far above 2**-24


def bytes_sent() -> int:
    return int(dict(line.split(": ") for line in WIO.read_text().splitlines())["wchar"])


def fp8_rounding_bound(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Per element, the most one fp8 rounding of x (one per-tensor scale) can err by: half an
    ulp (2**-(m+1) relative) or half the smallest subnormal, over the scale s; a power-of-two
    s is at least fp8_max / (2 * amax)."""
    m, emin = FP8_BITS[fp8_dtype]
    amax = x.abs().max().double()
    least_scale = torch.finfo(fp8_dtype).max / (2 * amax)
    return torch.maximum(x.abs().double() * 2.0 ** -(m + 1), 2.0 ** (emin - m - 1) / least_scale)


def fp8_sum_bound(rows: torch.Tensor, fp8_dtype: torch.dtype, requantized: bool) -> torch.Tensor:
    """Bound on |fp8-communicated sum - exact sum| of rows (one row per rank): each rank's row
    rounded once (its own scale), the sum once more when the all-reduce re-quantizes it."""
    bound = sum(fp8_rounding_bound(row, fp8_dtype) for row in rows)
    bound = bound + FP32_SUM * rows.abs().double().sum(0)
    if requantized:
        worst = rows.double().sum(0).abs() + bound  # the largest the rounded sum can be
        bound = bound + fp8_rounding_bound(worst, fp8_dtype)
    return bound


def gathered(t: torch.Tensor) -> torch.Tensor:
    """(world, n): every rank's flat t."""
    flat = t.detach().reshape(-1).float().contiguous()
    out = torch.empty(dist.get_world_size() * flat.numel())
    dist.all_gather_into_tensor(out, flat)
    return out.view(dist.get_world_size(), -1)


# ----- the collectives -----
def _collectives_worker(rank: int, world: int) -> None:
    torch.manual_seed(rank)
    # Magnitudes over 6 decades: small elements fall into fp8's subnormals under one scale.
    x = torch.randn(4099) * 10.0 ** torch.empty(4099).uniform_(-5, 1)
    rows = gathered(x)
    exact = rows.double().sum(0)
    for fp8 in (E4M3, E5M2):
        out = fp8_all_reduce(x, None, fp8)
        assert out.dtype == x.dtype and out.shape == x.shape
        err = (out.double() - exact).abs()
        assert (err <= fp8_sum_bound(rows, fp8, requantized=True)).all(), fmt_worst(err, exact)
        assert err.max() > 0  # it did go through fp8
        assert_same_on_every_rank([out], f"fp8 all-reduce {fp8}")  # replicas stay equal
        flat = x[:4098]
        chunk = fp8_reduce_scatter(flat, None, fp8)
        n = flat.numel() // world
        mine = slice(rank * n, (rank + 1) * n)
        err = (chunk.double() - exact[:4098][mine]).abs()
        bound = fp8_sum_bound(rows[:, :4098], fp8, requantized=False)[mine]
        assert (err <= bound).all(), fmt_worst(err, exact[mine])
    # Bytes: fp32's ring all-reduce sends 2 (w-1)/w x 4 bytes per element; fp8's all-reduce
    # (all-to-all + all-gather) 2 (w-1)/w x 1, its reduce-scatter half that (+ the scales).
    big = torch.randn(2**20)
    sent = {}
    for name, reduce in (
        ("fp32", lambda: dist.all_reduce(big.clone())),
        ("fp8 all-reduce", lambda: fp8_all_reduce(big, None, E5M2)),
        ("fp8 reduce-scatter", lambda: fp8_reduce_scatter(big, None, E5M2)),
    ):
        dist.barrier()
        before = bytes_sent()
        reduce()
        sent[name] = bytes_sent() - before
    assert sent["fp32"] >= 4 * 2**20 * 2 * (world - 1) / world, sent
    assert sent["fp8 all-reduce"] * 3.9 < sent["fp32"], sent  # 4x, less headers and scales
    assert sent["fp8 reduce-scatter"] * 7.8 < sent["fp32"], sent
    # A non-finite gradient on one rank: nan everywhere, on every rank (the step will skip).
    y = x.clone()
    if rank == 1:
        y[7] = float("inf")
    assert fp8_all_reduce(y, None, E4M3).isnan().all()
    z = y[:4098]
    assert fp8_reduce_scatter(z, None, E5M2).isnan().all()


def fmt_worst(err: torch.Tensor, exact: torch.Tensor) -> str:
    i = int(err.argmax())
    return f"worst error {err[i].item():.3g} at {i} (exact {exact[i].item():.3g})"


@pytest.mark.distributed
def test_fp8_collectives_within_the_fp8_bound_and_count_their_bytes() -> None:
    spawn(_collectives_worker, 2)


def test_fp8_communication_values() -> None:
    assert to_fp8_comm_dtype(False, "X") is None
    assert to_fp8_comm_dtype(True, "X") == E5M2
    assert to_fp8_comm_dtype("e4m3", "X") == E4M3
    with pytest.raises(ValueError, match=r"X\(fp8_communication='fp16'\).*e4m3"):
        to_fp8_comm_dtype("fp16", "X")
    for plugin in (LowLevelZeroPlugin, TorchDDPPlugin, TorchFSDPPlugin, HybridParallelPlugin):
        with pytest.raises(ValueError, match=rf"{plugin.__name__}\(fp8_communication=1\)"):
            plugin(fp8_communication=1)
    with pytest.raises(ValueError, match="leave communication_dtype None"):
        LowLevelZeroPlugin(fp8_communication=True, communication_dtype=torch.float32)


# ----- the plugins -----
WIDTH = 16


WIDE = 64  # 8.6k params: payload, not gloo's per-collective headers, dominates the bytes


def _model(width: int = WIDTH) -> nn.Module:
    return nn.Sequential(
        nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 4)
    )


def _data(rank: int, n: int = 8, width: int = WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own batch
    return torch.randn(n, width, generator=g), torch.randn(n, 4, generator=g)


def _local_grads(rank: int) -> torch.Tensor:
    """This rank's own gradient of the fp32 model (what it hands to the reduction)."""
    torch.manual_seed(0)
    model = _model(WIDE)
    x, y = _data(rank, width=WIDE)
    nn.functional.mse_loss(model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _one_sgd_step(plugin, rank: int) -> tuple[torch.Tensor, int]:  # noqa: ANN001
    """fp32 model, SGD(lr=1): (the applied mean gradient, bytes sent by backward + step)."""
    torch.manual_seed(0)
    model = _model(WIDE)
    before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    booster = Booster(plugin=plugin)
    model, opt, criterion, *_ = booster.boost(
        model, torch.optim.SGD(model.parameters(), lr=1.0), nn.MSELoss()
    )
    x, y = _data(rank, width=WIDE)
    loss = criterion(model(x), y)  # the hybrid plugin's pp_size=1 runs the ordinary loop too
    dist.barrier()
    sent = bytes_sent()
    booster.backward(loss, opt)  # DDP reduces here
    assert not opt.step().skipped  # ZeRO and the hybrid plugin here
    sent = bytes_sent() - sent
    hp = getattr(opt, "hp_params", None)
    params = hp() if hp else [getattr(p, "full_tensor", p.detach)() for p in model.parameters()]
    after = torch.cat([p.detach().reshape(-1) for p in params])
    return before - after, sent


def _plugins_worker(rank: int, world: int) -> None:
    rows = gathered(_local_grads(rank))
    cases = {
        "DDP": (TorchDDPPlugin(), TorchDDPPlugin(fp8_communication=True), E5M2, True),
        "ZeRO-2": (
            LowLevelZeroPlugin(stage=2, precision="fp32"),
            LowLevelZeroPlugin(stage=2, precision="fp32", fp8_communication="e4m3"),
            E4M3,
            False,  # each owner sums its chunk in fp32: one fp8 rounding
        ),
        "ZeRO-1": (
            LowLevelZeroPlugin(stage=1, precision="fp32"),
            LowLevelZeroPlugin(stage=1, precision="fp32", fp8_communication=True),
            E5M2,
            False,
        ),
        "FSDP2": (
            TorchFSDPPlugin(),
            TorchFSDPPlugin(fp8_communication=True),
            E5M2,
            False,  # each unit reduce-scattered: one fp8 rounding
        ),
        "hybrid dp": (
            HybridParallelPlugin(precision="fp32"),
            HybridParallelPlugin(precision="fp32", fp8_communication=True),
            E5M2,
            True,  # each gradient all-reduced (its own scale) over the stage's replicas
        ),
    }
    for name, (fp32_plugin, fp8_plugin, fp8, requantized) in cases.items():
        ref, ref_bytes = _one_sgd_step(fp32_plugin, rank)
        delta, fp8_bytes = _one_sgd_step(fp8_plugin, rank)
        # Scales from each rank's whole buffer: the amax of all its grads bounds any bucket's
        # or tensor's amax, and a smaller amax only shrinks the subnormal term.
        bound = fp8_sum_bound(rows, fp8, requantized) / world
        err = (delta.double() - ref.double()).abs()
        slack = 2**-22 * (1 + ref.abs().double())  # w - g rounded in fp32, twice
        assert (err <= bound + slack).all(), f"{name}: {fmt_worst(err, ref.double())}"
        assert err.max() > 0, name
        assert_same_on_every_rank([delta], f"{name} fp8: every replica steps alike")
        # Gradient bytes fall ~4x (all-reduce) or ~8x (ZeRO's reduce-scatter); ZeRO's step also
        # broadcasts the owners' fp32 params, FSDP2 all-gathers them in forward and again in
        # backward (two thirds of its bytes), which fp8 does not touch.
        assert fp8_bytes * {"DDP": 3, "hybrid dp": 3, "FSDP2": 1.25}.get(name, 2) < ref_bytes, (
            name,
            fp8_bytes,
            ref_bytes,
        )


@pytest.mark.slow
@pytest.mark.distributed
def test_fp8_communication_plugins_within_the_fp8_bound() -> None:
    spawn(_plugins_worker, 2)


def _skip_worker(rank: int, world: int) -> None:
    """An inf in one rank's gradients: every rank skips, nothing moves, bit for bit."""
    for name, booster_kwargs in (
        ("DDP fp16", {"plugin": TorchDDPPlugin(fp8_communication=True), "mixed_precision": "fp16"}),
        ("ZeRO fp16", {"plugin": LowLevelZeroPlugin(initial_scale=2**8, fp8_communication=True)}),
    ):
        torch.manual_seed(0)
        model = _model()
        booster = Booster(**booster_kwargs)
        model, opt, criterion, *_ = booster.boost(
            model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss()
        )
        x, y = _data(rank)
        weights = [p.detach().clone() for p in model.parameters()]
        x_bad = x.clone()
        if rank == 1:
            x_bad[0, 0] = float("inf")
        booster.backward(criterion(model(x_bad), y), opt)
        assert opt.step().skipped, name
        opt.zero_grad()
        for w, p in zip(weights, model.parameters(), strict=True):
            torch.testing.assert_close(p.detach(), w, **EXACT, msg=name)
        assert_same_on_every_rank(
            [t for t in opt.scaler.state_dict().values() if torch.is_tensor(t)], name
        )
        booster.backward(criterion(model(x), y), opt)
        assert not opt.step().skipped, name  # the next finite step lands
        assert_same_on_every_rank(list(model.parameters()), name)


@pytest.mark.distributed
def test_fp8_communication_skips_agree_across_ranks() -> None:
    spawn(_skip_worker, 2)


def _converge_worker(rank: int, world: int) -> None:
    """A teacher-student regression trains as well with fp8 gradients as with fp32 ones."""
    torch.manual_seed(1)  # one teacher on every rank, every run (a spawned rank's seed is random)
    teacher = nn.Sequential(nn.Linear(WIDTH, 32), nn.Tanh(), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(3 + rank)
    xs = torch.randn(40, 16, WIDTH, generator=g)
    with torch.no_grad():
        ys = teacher(xs)
    finals = {}
    for name, plugin in (
        ("ZeRO fp32 comm", LowLevelZeroPlugin(precision="bf16")),
        ("ZeRO fp8 comm", LowLevelZeroPlugin(precision="bf16", fp8_communication=True)),
        ("DDP fp8 comm", TorchDDPPlugin(fp8_communication=True)),
    ):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(WIDTH, 32), nn.Tanh(), nn.Linear(32, 4))
        booster = Booster(plugin=plugin)
        model, opt, criterion, *_ = booster.boost(
            model, torch.optim.AdamW(model.parameters(), lr=1e-2), nn.MSELoss()
        )
        losses = []
        for x, y in zip(xs, ys, strict=True):
            loss = criterion(model(x), y)
            booster.backward(loss, opt)
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().float())
        total = torch.stack(losses[-5:]).mean().reshape(1)
        dist.all_reduce(total)
        finals[name] = (losses[0].item(), total.item() / world)
    first, ref = finals["ZeRO fp32 comm"]
    assert ref < 0.5 * first, finals  # learned: 40 steps cut the loss ~50x (measured)
    for name in ("ZeRO fp8 comm", "DDP fp8 comm"):
        # fp8 gradients (~2**-3 relative noise, unbiased-ish) cost Adam little on 40 steps.
        assert finals[name][1] < 1.25 * ref, finals


@pytest.mark.slow
@pytest.mark.distributed
def test_fp8_communication_trains_as_fp32_communication() -> None:
    spawn(_converge_worker, 2)


# ----- the DDP fp8 hook: asynchronous, the same bits as the synchronous all-reduce -----
class _Bucket:
    """What the hook reads of a dist.GradBucket (which Python cannot construct)."""

    def __init__(self, buffer: torch.Tensor, last: bool) -> None:
        self._buffer, self._last = buffer, last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def is_last(self) -> bool:
        return self._last


PEER_LATE = 1.0  # seconds rank 1 sleeps before its first hook call


def _hook_async_worker(rank: int, world: int) -> None:
    torch.manual_seed(rank)
    buffers = [torch.randn(1000), torch.randn(333)]
    hook = fp8_ddp_comm_hook(E5M2)
    if rank == 1:
        time.sleep(PEER_LATE)
    start = time.perf_counter()
    first = hook(None, _Bucket(buffers[0].clone(), last=False))
    returned_after = time.perf_counter() - start
    if rank == 0:
        # Rank 1 has not joined yet, so no collective of this bucket can have completed: the
        # hook returned without waiting for one.
        assert returned_after < PEER_LATE / 2, returned_after
        assert not first.done()
    last = hook(None, _Bucket(buffers[1].clone(), last=True))  # gathers both buckets
    for fut, buffer in zip((first, last), buffers, strict=True):
        reference = fp8_all_reduce(buffer, None, E5M2).div_(world)  # the synchronous path
        torch.testing.assert_close(fut.wait(), reference, **EXACT)


def _sync_fp8_hook(group, bucket):  # noqa: ANN001, ANN202 - DDP checks hook annotations
    """The hook as it was: every bucket reduced before the hook returns."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(fp8_all_reduce(bucket.buffer(), group, E5M2).div_(dist.get_world_size()))
    return future


def _ddp_hook_worker(rank: int, world: int) -> None:
    """Real DDP, several buckets, accumulation under no_sync: the asynchronous hook's grads
    are the synchronous one's bit for bit, and its non-last buckets return unfinished."""
    for ddp_kwargs in ({}, {"gradient_as_bucket_view": True, "find_unused_parameters": True}):
        models, done_at_return = [], []
        for asynchronous in (False, True):
            torch.manual_seed(0)
            hook = fp8_ddp_comm_hook(E5M2)

            def recorded(group, bucket, hook=hook, log=done_at_return):  # noqa: ANN001, ANN202
                future = hook(group, bucket)
                log.append((bucket.is_last(), future.done()))
                return future

            # ~1 KB buckets: the 8.6k params in several, reduced during backward
            ddp = nn.parallel.DistributedDataParallel(
                _model(WIDE), bucket_cap_mb=2**-10, **ddp_kwargs
            )
            ddp.register_comm_hook(None, recorded if asynchronous else _sync_fp8_hook)
            models.append(ddp)
        x, y = _data(rank, 16, WIDE)
        for step in range(3):
            for ddp in models:
                if step == 1:
                    with ddp.no_sync():
                        nn.functional.mse_loss(ddp(x[:8]), y[:8]).backward()
                nn.functional.mse_loss(ddp(x[8:]), y[8:]).backward()
            for a, b in zip(models[1].parameters(), models[0].parameters(), strict=True):
                torch.testing.assert_close(a.grad, b.grad, **EXACT, msg=f"{ddp_kwargs} {step}")
            assert_same_on_every_rank([p.grad for p in models[1].parameters()], "async hook")
        # DDP's first backward puts everything in one bucket; the rebuilt ones are several
        early = [done for last, done in done_at_return if not last]
        assert len(early) >= 2 and not any(early), done_at_return
        del models


def _ddp_hook_workers(rank: int, world: int) -> None:
    _hook_async_worker(rank, world)
    _ddp_hook_worker(rank, world)


@pytest.mark.distributed
def test_fp8_ddp_hook_is_asynchronous_and_bit_identical_to_the_synchronous_one() -> None:
    """One spawn for both workers: starting the processes is most of the time."""
    spawn(_ddp_hook_workers, 2)


# ----- overlap_communication: reduced during backward, bit-identical results -----
def _overlap_run(rank: int, stage: int, precision: str, overlap: bool, fp8: bool, accumulate):  # noqa: ANN001, ANN202
    torch.manual_seed(0)
    model = _model()
    scaling = {"initial_scale": 2**8} if precision.startswith("fp16") else {}  # else refused
    plugin = LowLevelZeroPlugin(
        stage=stage,
        precision=precision,
        reduce_bucket_size_in_m=200 / 2**20,  # 200 elements: the model's 628 in several
        overlap_communication=overlap,
        fp8_communication=fp8,
        **scaling,
    )
    booster = Booster(plugin=plugin)
    model, opt, criterion, *_ = booster.boost(
        model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), nn.MSELoss()
    )
    x, y = _data(rank, 16)
    launched = []
    for _ in range(3):
        if accumulate == "no_sync":
            with booster.no_sync(model):
                booster.backward(criterion(model(x[:8]), y[:8]), opt)
            assert not opt.buckets.pending  # inside no_sync nothing is reduced
            booster.backward(criterion(model(x[8:]), y[8:]), opt)
        elif accumulate == "twice":  # without no_sync: the second backward redoes the buckets
            booster.backward(criterion(model(x[:8]), y[:8]), opt)
            booster.backward(criterion(model(x[8:]), y[8:]), opt)
        else:
            booster.backward(criterion(model(x), y), opt)
        launched.append(len(opt.buckets.pending))
        opt.step()
        opt.zero_grad()
    buckets = len(opt.buckets.plan())
    assert buckets > 1  # several buckets: some are launched before backward ends
    return [p.detach().clone() for p in opt.hp_params()], [n / buckets for n in launched]


def _overlap_worker(rank: int, world: int) -> None:
    for stage in (1, 2):
        for precision in ("fp16", "bf16", "fp32"):
            for fp8 in (False, True):
                for accumulate in (None, "no_sync", "twice"):
                    what = f"stage {stage} {precision} fp8={fp8} accumulate={accumulate}"
                    ref, none = _overlap_run(rank, stage, precision, False, fp8, accumulate)
                    got, launched = _overlap_run(rank, stage, precision, True, fp8, accumulate)
                    # every bucket launched in backward with overlap, none without
                    assert none == [0, 0, 0] and launched == [1, 1, 1], (what, launched)
                    for a, b in zip(got, ref, strict=True):
                        torch.testing.assert_close(a, b, **EXACT, msg=what)


@pytest.mark.slow
@pytest.mark.distributed
def test_overlap_communication_reduces_in_backward_bit_identically() -> None:
    spawn(_overlap_worker, 2)


class _Branchy(nn.Module):
    """A trunk and two heads; head_b only where the caller asks (control flow per rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.head_a = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 4)
        self.head_b = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return self.head_a(h) + self.head_b(h) if use_b else self.head_a(h)


def _default_overlap_worker(rank: int, world: int) -> None:
    """Rank 1's backward skips head_b. With the default (reduced at step(), in bucket order on
    every rank) the step applies the mean over ranks of each rank's gradient, zero where a rank
    has none, bit for bit; overlap_communication=True would launch head_b's bucket on rank 0
    only, out of order with rank 1's collectives."""
    use_b = rank == 0
    x, y = _data(rank)
    torch.manual_seed(0)
    plain = _Branchy()
    nn.functional.mse_loss(plain(x, use_b), y).backward()
    local = [p.grad if p.grad is not None else torch.zeros_like(p) for p in plain.parameters()]
    rows = gathered(torch.cat([g.reshape(-1) for g in local]))
    mean = (rows[0] + rows[1]) / world  # gloo's two-rank sum, then the mean, in fp32
    before = torch.cat([p.detach().reshape(-1) for p in plain.parameters()])
    torch.manual_seed(0)
    # 64 elements a bucket: the heads and the trunk each in buckets of their own
    plugin = LowLevelZeroPlugin(stage=2, precision="fp32", reduce_bucket_size_in_m=64 / 2**20)
    assert plugin.overlap_communication is False  # the default, unlike Colossal's
    booster, model = Booster(plugin=plugin), _Branchy()
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=1.0))
    assert len(opt.buckets.plan()) > 2
    booster.backward(nn.functional.mse_loss(model(x, use_b), y), opt)
    assert not opt.step().skipped
    after = torch.cat([p.detach().reshape(-1) for p in opt.hp_params()])
    torch.testing.assert_close(after, before - mean, **EXACT)
    assert_same_on_every_rank([after], "ranks touching different params")


@pytest.mark.distributed
def test_default_no_overlap_lets_ranks_give_grads_to_different_params() -> None:
    spawn(_default_overlap_worker, 2)
