"""Tests for mixprec.fp8: scale math, casts, Float8Linear numerics, conversion, checkpoints.

Tolerance for lossy float8 results is a signal-to-noise floor in dB,
SNR = 20 * log10(||ref|| / ||ref - out||). One cast to e4m3 (3 mantissa bits, round to
nearest) leaves a relative RMS error of about 2**-4 / sqrt(3) ~ 3.6%, ~29 dB; to e5m2 (2 bits)
about 7%, ~23 dB. A GEMM's output carries the errors of both of its operands' casts, so:
  out = x(e4m3) w(e4m3)               -> ~28 dB measured; floor 25 dB
  grad_input, grad_weight = g(e5m2) . -> ~24.5 dB measured; floor 21 dB
Each floor sits ~3.5 dB (a factor 1.5 in error) under the measured value: loose enough for
other seeds, tight enough that a lost scale or a wrong format (e5m2 where e4m3 is due costs
~5 dB; a wrong scale costs tens) fails.
"""

from __future__ import annotations

import copy
import logging
import math
import pickle

import pytest
import torch
from torch import nn

from mixprec.fp8 import (
    Float8Config,
    Float8Linear,
    amax_to_scale,
    convert_to_fp8,
    default_fp8_filter,
    delayed_amax,
    fp8_kernel_problem,
    fp8_summary,
    fp8_to_tensor,
    resolve_emulate,
    tensor_to_amax,
    tensor_to_fp8,
)
from mixprec.fp8 import kernels as fp8_kernels

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
OUT_SNR_FLOOR_DB = 25.0
GRAD_SNR_FLOOR_DB = 21.0
needs_cpu_kernel = pytest.mark.skipif(
    not fp8_kernels.cpu_has_scaled_mm(), reason="this torch has no CPU torch._scaled_mm"
)


def snr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return (20 * torch.log10(ref.norm() / (ref - out).norm())).item()


def all_finite_values(lp_dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of a float8 format, from its 256 bit patterns, as fp32."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(lp_dtype).float()
    return values[torch.isfinite(values)]


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"scaling": "delay"}, ValueError, "Did you mean 'delayed'"),
        ({"scaling": "static"}, ValueError, "'dynamic', 'delayed'"),
        ({"grad_dtype": "e5m3"}, ValueError, "'e5m2'"),
        ({"amax_history_len": 0}, ValueError, "amax_history_len=0"),
        ({"amax_history_len": 2.0}, TypeError, "2.0"),
        ({"margin": -1}, ValueError, "margin=-1"),
        ({"margin": True}, TypeError, "True"),
        ({"power_of_two_scale": 1}, TypeError, "power_of_two_scale"),
        ({"emulate": "yes"}, TypeError, "'yes'"),
        ({"emulate": False, "allow_emulation": True}, ValueError, "contradicts"),
    ],
)
def test_config_rejects_bad_values_naming_them(kwargs, error, needle):
    with pytest.raises(error, match=needle):
        Float8Config(**kwargs)


def test_config_is_frozen_and_keyword_only():
    config = Float8Config()
    with pytest.raises(AttributeError):
        config.scaling = "delayed"  # type: ignore[misc]
    with pytest.raises(TypeError):
        Float8Config("delayed")  # type: ignore[misc]
    assert config.lp_grad_dtype == E5M2
    assert Float8Config(grad_dtype="e4m3").lp_grad_dtype == E4M3


# ----------------------------------------------------------------------------- scale math


@pytest.mark.parametrize("lp_dtype", [E4M3, E5M2])
def test_representable_values_round_trip_bitwise(lp_dtype):
    values = all_finite_values(lp_dtype)
    one = torch.tensor(1.0)
    lp = tensor_to_fp8(values, one, lp_dtype)
    torch.testing.assert_close(fp8_to_tensor(lp, one, torch.float32), values, rtol=0, atol=0)


@pytest.mark.parametrize("lp_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("shift", [-7, 3])
def test_power_of_two_scale_round_trips_exactly(lp_dtype, shift):
    # Values of the format times 2**shift: a power-of-two scale undoes the shift exactly.
    values = all_finite_values(lp_dtype) * 2.0**shift
    scale = amax_to_scale(tensor_to_amax(values), lp_dtype, power_of_two=True)
    assert scale.item() == 2.0**-shift
    lp = tensor_to_fp8(values, scale, lp_dtype)
    torch.testing.assert_close(fp8_to_tensor(lp, scale, torch.float32), values, rtol=0, atol=0)


def test_amax_to_scale_values():
    lp_max = torch.finfo(E4M3).max
    amax = torch.tensor([3.0, 0.01, 448.0, 1e-3, 7e4])
    scale = amax_to_scale(amax, E4M3)
    assert scale.dtype == torch.float32
    torch.testing.assert_close(scale, (lp_max / amax.double()).float(), rtol=0, atol=0)
    # margin=2: exactly a quarter (a power-of-two division is exact in fp32).
    torch.testing.assert_close(amax_to_scale(amax, E4M3, margin=2), scale / 4, rtol=0, atol=0)
    pow2 = amax_to_scale(amax, E4M3, power_of_two=True)
    expected = torch.tensor([2.0 ** math.floor(math.log2(lp_max / a)) for a in amax.tolist()])
    torch.testing.assert_close(pow2, expected, rtol=0, atol=0)
    assert bool(((pow2 * amax) <= lp_max).all())  # rounding down never overflows the format


def test_amax_to_scale_guards_zero_and_propagates_overflow():
    scale = amax_to_scale(torch.tensor(0.0), E4M3)
    assert torch.isfinite(scale) and scale.item() > 0
    assert tensor_to_fp8(torch.zeros(4), scale, E4M3).float().abs().sum().item() == 0.0
    # An inf amax must not be hidden: scale 0 turns the tensor into nan downstream.
    for power_of_two in (False, True):
        inf, nan = torch.tensor(float("inf")), torch.tensor(float("nan"))
        assert amax_to_scale(inf, E4M3, power_of_two=power_of_two).item() == 0.0
        assert amax_to_scale(nan, E4M3, power_of_two=power_of_two).isnan()
    assert tensor_to_amax(torch.tensor([1.0, float("nan")])).isnan()
    assert tensor_to_amax(torch.tensor([1.0, -float("inf")])).item() == float("inf")


def test_tensor_to_amax_is_exact_fp32():
    x = torch.tensor([[-3.5, 2.0], [1.0, -0.25]], dtype=torch.bfloat16)
    amax = tensor_to_amax(x)
    assert amax.dtype == torch.float32 and amax.dim() == 0 and amax.item() == 3.5


def test_tensor_to_fp8_saturates_and_keeps_nan():
    one = torch.tensor(1.0)
    for lp_dtype in (E4M3, E5M2):
        lp_max = torch.finfo(lp_dtype).max
        big = torch.tensor([lp_max * 4, -lp_max * 4, float("inf"), float("nan")])
        out = tensor_to_fp8(big, one, lp_dtype).float()
        assert out[:3].tolist() == [lp_max, -lp_max, lp_max]
        assert out[3].isnan()


def test_tensor_to_fp8_scales_bf16_inputs_in_fp32():
    # 1.0625 is the e4m3 midpoint between 1 and 1.125. Times 1 + 2**-10 in fp32 it lies above
    # (-> 1.125); a bf16 product would round back to 1.0625 and tie to even (-> 1.0).
    x = torch.tensor([1.0625], dtype=torch.bfloat16)
    scale = torch.tensor(1.0 + 2.0**-10)
    assert tensor_to_fp8(x, scale, E4M3).float().item() == 1.125
    assert (x * scale).to(E4M3).float().item() == 1.0  # what the naive product would give


def test_delayed_amax_takes_the_max_of_the_last_n():
    history = torch.zeros(3)
    chosen = [delayed_amax(history, torch.tensor(a)).item() for a in (1.0, 5.0, 2.0, 3.0, 4.0, 0.5)]
    # First call: empty history -> its own amax; then the max over the previous 3 calls.
    assert chosen == [1.0, 1.0, 5.0, 5.0, 5.0, 4.0]
    assert history.tolist() == [0.5, 4.0, 3.0]


# ----------------------------------------------------------------------------- the layer


def make_pair(config: Float8Config, in_f: int = 256, out_f: int = 128, seed: int = 0):
    torch.manual_seed(seed)
    ref = nn.Linear(in_f, out_f)
    return ref, Float8Linear.from_float(copy.deepcopy(ref), config)


def fwd_bwd(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor, autocast: bool = False):
    x = x.detach().clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    with torch.autocast(torch.get_default_device().type, dtype=torch.bfloat16, enabled=autocast):
        out = layer(x)
    out.backward(grad.to(out.dtype))
    return out, x.grad, layer.weight.grad, layer.bias.grad


@pytest.mark.parametrize(
    "config",
    [
        Float8Config(),
        Float8Config(emulate=True),
        Float8Config(scaling="delayed", amax_history_len=4),
        Float8Config(power_of_two_scale=True, margin=1),
    ],
    ids=["dynamic", "emulated", "delayed", "pow2-margin"],
)
def test_float8_linear_snr_against_fp32(config):
    ref, f8 = make_pair(config)
    x = torch.randn(4, 32, 256)
    grad = torch.randn(4, 32, 128)
    ref_out, ref_gx, ref_gw, ref_gb = fwd_bwd(ref, x, grad)
    for _ in range(2):  # delayed scaling's second call uses the history, not the current amax
        out, gx, gw, gb = fwd_bwd(f8, x, grad)
    assert out.dtype == torch.float32 and out.shape == ref_out.shape
    assert snr_db(ref_out, out) > OUT_SNR_FLOOR_DB
    assert snr_db(ref_gx, gx) > GRAD_SNR_FLOOR_DB
    assert snr_db(ref_gw, gw) > GRAD_SNR_FLOOR_DB
    # The bias never goes through float8: its gradient is the same fp32 sum.
    torch.testing.assert_close(gb, ref_gb, rtol=0, atol=0)
    assert f8.weight.dtype == torch.float32 and gw.dtype == torch.float32


def test_float8_linear_is_lossy_where_it_should_be():
    # Guard against a layer that silently runs in high precision: fp8 must cost SNR.
    ref, f8 = make_pair(Float8Config())
    x, grad = torch.randn(64, 256), torch.randn(64, 128)
    out, gx, _, _ = fwd_bwd(f8, x, grad)
    ref_out, ref_gx, _, _ = fwd_bwd(ref, x, grad)
    assert snr_db(ref_out, out) < 40 and snr_db(ref_gx, gx) < 35
    # e4m3 gradients carry one more mantissa bit than e5m2: measurably better grad_input.
    _, f8_e4m3 = make_pair(Float8Config(grad_dtype="e4m3"))
    _, gx_e4m3, _, _ = fwd_bwd(f8_e4m3, x, grad)
    assert snr_db(ref_gx, gx_e4m3) > snr_db(ref_gx, gx) + 2


def test_dtypes_under_autocast_and_without():
    ref, f8 = make_pair(Float8Config())
    x, grad = torch.randn(16, 256), torch.randn(16, 128)
    out, gx, gw, gb = fwd_bwd(f8, x, grad, autocast=True)
    assert out.dtype == torch.bfloat16  # the autocast dtype
    assert gx.dtype == torch.float32 and gw.dtype == torch.float32 and gb.dtype == torch.float32
    ref_out, ref_gx, ref_gw, _ = fwd_bwd(ref, x, grad, autocast=True)
    assert snr_db(ref_out.float(), out.float()) > OUT_SNR_FLOOR_DB
    assert snr_db(ref_gw, gw) > GRAD_SNR_FLOOR_DB
    out, gx, _, _ = fwd_bwd(f8, x.bfloat16(), grad)  # no autocast: the input's dtype
    assert out.dtype == torch.bfloat16 and gx.dtype == torch.bfloat16
    assert f8.weight.dtype == torch.float32  # parameters are never cast in place


def test_input_without_grad_and_no_bias():
    torch.manual_seed(0)
    f8 = Float8Linear(32, 16, bias=False)
    x = torch.randn(8, 32)  # requires_grad False: the grad_input GEMM is skipped
    f8(x).sum().backward()
    assert f8.weight.grad is not None and f8.bias is None
    assert "scaling=dynamic" in repr(f8)


@needs_cpu_kernel
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("shape", [(64, 256, 128), (100, 96, 48)])  # M need not be 16-aligned
def test_emulated_matches_the_real_kernel(shape, autocast):
    m, k, n = shape
    real, _ = make_pair(Float8Config(), k, n)
    # fast accumulation off: the contract below is the kernel's full fp32 accumulation
    exact_sum = Float8Config(emulate=False, use_fast_accum_forward=False)
    real = Float8Linear.from_float(real, exact_sum)
    emulated = Float8Linear.from_float(copy.deepcopy(real), Float8Config(emulate=True))
    x, grad = torch.randn(m, k), torch.randn(m, n)
    bias = real.bias.detach().abs().float()
    for name, got, want in zip(
        ("out", "grad_x", "grad_w", "grad_b"),
        fwd_bwd(real, x, grad, autocast),
        fwd_bwd(emulated, x, grad, autocast),
        strict=True,
    ):
        # Same exact fp8 products, both summed in fp32: only summation order (~1e-6 of the
        # largest entry, measured 4e-7 on AMD and 5e-7 on Intel's oneDNN kernel) and the GEMM's
        # rounding to its output dtype (one bf16 ulp, 2**-7) differ. For `out` that ulp is of
        # the GEMM before the bias is added (|gemm| <= |out| + |bias|): where the bias cancels
        # the GEMM, one ulp of it is several of the output (seen on Intel: 2 ulps at 0.0022).
        got, want = got.float(), want.float()
        gemm_size = want.abs() + (bias if name == "out" else 0)
        bound = 2.0**-7 * gemm_size + 1e-6 * want.abs().max()
        assert bool(((got - want).abs() <= bound).all()), name


def test_lp_gemm_padding_adds_zeros_only():
    lp = torch.randn(5, 20).to(E4M3)
    padded = fp8_kernels._pad_dim(fp8_kernels._pad_dim(lp, 0), 1)
    assert padded.shape == (16, 32) and padded.dtype == E4M3
    assert torch.equal(padded[:5, :20].view(torch.uint8), lp.view(torch.uint8))
    assert padded.float()[5:].abs().sum().item() == 0 and padded.float()[:, 20:].abs().sum() == 0


# ----------------------------------------------------------------------------- hardware


def fake_cuda(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")


def test_old_cuda_names_the_requirement_and_offers_emulation(monkeypatch, caplog):
    fake_cuda(monkeypatch, (8, 0))
    problem = fp8_kernel_problem("cuda")
    assert "8.9" in problem and "sm_80" in problem and "Fake GPU" in problem
    with pytest.raises(RuntimeError, match=r"8\.9.*emulate=True"):
        resolve_emulate("cuda", Float8Config())
    with pytest.raises(RuntimeError, match="sm_80"):
        resolve_emulate("cuda", Float8Config(emulate=False))
    assert resolve_emulate("cuda", Float8Config(emulate=True)) is True
    monkeypatch.setattr(fp8_kernels, "_FALLBACK_LOGGED", set())
    with caplog.at_level(logging.WARNING, logger="mixprec.fp8"):
        assert resolve_emulate("cuda", Float8Config(allow_emulation=True)) is True
    assert "emulating float8" in caplog.text
    fake_cuda(monkeypatch, (9, 0))
    assert fp8_kernel_problem("cuda") is None
    assert resolve_emulate("cuda", Float8Config()) is False


def test_cpu_emulates_by_default_and_demanding_a_missing_kernel_fails_at_conversion(
    monkeypatch, caplog
):
    # torch's CPU _scaled_mm is a reference kernel hundreds of times slower than an fp32 GEMM:
    # the default (emulate=None) emulates on CPU, with the same fp8 rounding.
    monkeypatch.setattr(fp8_kernels, "_FALLBACK_LOGGED", set())
    with caplog.at_level(logging.INFO, logger="mixprec.fp8"):
        assert resolve_emulate("cpu", Float8Config()) is True
    assert "emulate=False" in caplog.text
    monkeypatch.setitem(fp8_kernels._CPU_KERNEL, "ok", False)
    with pytest.raises(RuntimeError, match="no CPU kernel.*emulate=True"):
        convert_to_fp8(nn.Sequential(nn.Linear(16, 16)), config=Float8Config(emulate=False))
    model = convert_to_fp8(nn.Sequential(nn.Linear(16, 16)))
    summary = fp8_summary(model)
    assert summary.converted == ("0",)
    assert model(torch.randn(4, 16)).shape == (4, 16)
    assert "device type 'mps'" in fp8_kernel_problem("mps")


# ----------------------------------------------------------------------------- conversion


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 128)
        self.odd = nn.Linear(30, 64)
        self.head = nn.Linear(128, 10)
        self.attn = nn.MultiheadAttention(32, 2)  # out_proj: an nn.Linear subclass
        self.tied = nn.Linear(32, 32)
        self.again = self.tied  # the same module under two names


def test_filter_summary_names_every_layer_left_and_why(caplog):
    model = Block()
    with caplog.at_level(logging.INFO, logger="mixprec.fp8"):
        model = convert_to_fp8(model)
    summary = fp8_summary(model)
    assert sorted(summary.converted) == ["again", "tied", "up"]
    assert isinstance(model.up, Float8Linear) and model.tied is model.again
    assert set(summary.skipped) == {"odd", "head", "attn"}  # attn's out_proj: named with it
    assert "in_features=30" in summary.skipped["odd"]
    assert "out_features=10" in summary.skipped["head"]
    assert "F.multi_head_attention_forward" in summary.skipped["attn"]
    assert type(model.head) is nn.Linear
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and all(name in warnings[0] for name in ("odd", "head", "attn"))
    assert "3 Linear layer(s) converted, 3 left" in str(summary)
    again = fp8_summary(convert_to_fp8(model))  # converting twice is harmless and says so
    assert again.converted == () and again.skipped["up"] == "already a Float8Linear"


def test_custom_filter_reasons_and_bad_verdicts():
    def no_head(module: nn.Linear, fqn: str) -> bool | str:
        return "the head stays bf16" if fqn == "2" else default_fp8_filter(module, fqn)

    mlp = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    summary = fp8_summary(convert_to_fp8(mlp, module_filter_fn=no_head))
    assert summary.converted == ("0",) and summary.skipped == {"2": "the head stays bf16"}
    summary = fp8_summary(convert_to_fp8(nn.Sequential(nn.Linear(16, 16)), lambda m, f: False))
    assert summary.skipped == {"0": "module_filter_fn returned False"}
    with pytest.raises(TypeError, match=r"returned 1 for '0'"):
        convert_to_fp8(nn.Sequential(nn.Linear(16, 16)), lambda m, f: 1)
    with pytest.raises(TypeError, match="nn.Module"):
        convert_to_fp8("model")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Float8Config"):
        convert_to_fp8(nn.Linear(16, 16), config={"scaling": "delayed"})  # type: ignore[arg-type]


def test_root_linear_is_returned_converted_sharing_parameters():
    linear = nn.Linear(32, 16)
    model = convert_to_fp8(linear)
    summary = fp8_summary(model)
    assert isinstance(model, Float8Linear) and summary.converted == ("",)
    assert model.weight is linear.weight and model.bias is linear.bias  # optimizers stay valid


# ----------------------------------------------------------------------------- state


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


@pytest.mark.parametrize("scaling", ["dynamic", "delayed"])
def test_state_dict_loads_both_ways_with_nn_linear(scaling):
    fp8 = convert_to_fp8(mlp(0), config=Float8Config(scaling=scaling))
    fp8(torch.randn(8, 32))  # delayed: fills the history, which is not a checkpoint key
    plain = mlp(1)
    assert list(fp8.state_dict()) == list(plain.state_dict())
    plain.load_state_dict(fp8.state_dict())  # strict
    for key, value in fp8.state_dict().items():
        torch.testing.assert_close(plain.state_dict()[key], value, rtol=0, atol=0)
    fresh = convert_to_fp8(mlp(2), config=Float8Config(scaling=scaling))
    fresh.load_state_dict(mlp(3).state_dict())
    torch.testing.assert_close(fresh[0].weight, mlp(3)[0].weight, rtol=0, atol=0)


def test_persisted_history_resumes_exactly_and_plain_checkpoints_still_load():
    config = Float8Config(scaling="delayed", amax_history_len=4, persist_amax_history=True)
    fp8 = convert_to_fp8(mlp(0), config=config)
    x = torch.randn(8, 32)
    fp8(x).sum().backward()
    state = fp8.state_dict()
    assert "0.grad_amax_history" in state and state["0.grad_amax_history"][0] > 0
    resumed = convert_to_fp8(mlp(1), config=config)
    resumed.load_state_dict(state)
    torch.testing.assert_close(resumed(x), fp8(x), rtol=0, atol=0)
    resumed.load_state_dict(mlp(2).state_dict())  # no history keys: it restarts from zeros
    assert resumed[0].input_amax_history.abs().sum().item() == 0


@pytest.mark.parametrize("scaling", ["dynamic", "delayed"])
def test_deepcopy_and_pickle(scaling):
    model = convert_to_fp8(mlp(0), config=Float8Config(scaling=scaling))
    x = torch.randn(8, 32)
    model(x)
    clones = [copy.deepcopy(model), pickle.loads(pickle.dumps(model))]
    for clone in clones:
        assert clone[0].config == model[0].config
        for b, c in zip(clone.buffers(), model.buffers(), strict=True):
            torch.testing.assert_close(b, c, rtol=0, atol=0)
    want = model(x)
    for clone in clones:  # each clone's first call sees the state the model's second call saw
        torch.testing.assert_close(clone(x), want, rtol=0, atol=0)


@pytest.mark.parametrize("scaling", ["dynamic", "delayed"])
def test_compiled_forward_backward_matches_eager(device: str, scaling):
    # aot_eager runs dynamo and AOTAutograd (where an autograd.Function or a buffer mutated in
    # backward would break) in ~2 s; inductor's codegen would add ~20 s on 2 cores, and by
    # default skips the bias's bf16 rounding (emulate_precision_casts=False): 1-ulp diffs.
    eager = convert_to_fp8(mlp(0), config=Float8Config(scaling=scaling))
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    x = torch.randn(16, 32)
    for _ in range(2):
        with torch.autocast(device, dtype=torch.bfloat16):
            want, got = eager(x), compiled(x)
        want.float().sum().backward()
        got.float().sum().backward()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for p, q in zip(compiled_model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    for b, c in zip(compiled_model.buffers(), eager.buffers(), strict=True):
        torch.testing.assert_close(b, c, rtol=0, atol=0)


# ----------------------------------------------------------------------------- training


def train_digits(fp8: bool) -> tuple[float, nn.Module]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0  # 64 features: already 16-aligned
    y = torch.tensor(digits.target)
    perm = torch.randperm(
        len(x), generator=torch.Generator(torch.get_default_device()).manual_seed(0)
    )
    train, test = perm[:1400], perm[1400:]
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
    )
    if fp8:  # the fp8 mode: bf16 autocast for the rest, float8 linears; the 10-way head stays
        model = convert_to_fp8(model)
        summary = fp8_summary(model)
        assert summary.converted == ("0", "2") and list(summary.skipped) == ["4"]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    batches = torch.Generator(torch.get_default_device()).manual_seed(1)
    for _ in range(10):
        order = train[torch.randperm(len(train), generator=batches)]
        for i in range(0, len(order), 32):
            idx = order[i : i + 32]
            with torch.autocast(torch.get_default_device().type, dtype=torch.bfloat16, enabled=fp8):
                loss = nn.functional.cross_entropy(model(x[idx]).float(), y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    with (
        torch.no_grad(),
        torch.autocast(torch.get_default_device().type, dtype=torch.bfloat16, enabled=fp8),
    ):
        accuracy = (model(x[test]).argmax(1) == y[test]).float().mean().item() * 100
    return accuracy, model


def test_digits_mlp_trains_to_fp32_accuracy_in_fp8():
    hp_accuracy, _ = train_digits(fp8=False)
    lp_accuracy, model = train_digits(fp8=True)
    assert isinstance(model[0], Float8Linear) and model[0].weight.dtype == torch.float32
    assert hp_accuracy > 90  # the reference itself learned
    # Within 1.5 points: float8 noise (~25 dB per GEMM) must not cost accuracy on this task.
    assert abs(lp_accuracy - hp_accuracy) <= 1.5, (hp_accuracy, lp_accuracy)


def test_fast_accum_reaches_the_kernel_forward_on_backward_off(monkeypatch) -> None:
    calls: list[bool] = []

    def recording_scaled_mm(a, b, *, scale_a, scale_b, out_dtype, use_fast_accum=False):
        calls.append(use_fast_accum)
        return ((a.float() @ b.float()) * scale_a * scale_b).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", recording_scaled_mm)
    monkeypatch.setitem(fp8_kernels._CPU_KERNEL, "ok", True)  # the recorder is the kernel
    for config, expected in (
        (Float8Config(emulate=False), [True, False, False]),  # torchao's default
        (
            Float8Config(emulate=False, use_fast_accum_forward=False, use_fast_accum_backward=True),
            [False, True, True],
        ),
    ):
        calls.clear()
        f8 = Float8Linear.from_float(nn.Linear(32, 16), config)
        f8(torch.randn(8, 32, requires_grad=True)).sum().backward()
        assert calls == expected  # forward, then backward's grad_input and grad_weight GEMMs
    with pytest.raises(TypeError, match="use_fast_accum_forward must be a bool"):
        Float8Config(use_fast_accum_forward=1)
