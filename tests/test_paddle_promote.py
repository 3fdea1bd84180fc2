"""Paddle's use_promote rule, observed in Paddle 3.3.1 and checked op by op against auto_cast.

The dtypes below were produced by PaddlePaddle 3.3.1 (pip paddlepaddle==3.3.1, CPU build) in
its static PIR mode, which applies the dygraph AMP rule (GetAmpDestDtype: white list low,
black list fp32, any other op fp32 when an input is fp32, else low; OD: every non-white op fp32;
use_promote=False: all low but the black list) at graph-build time. Its dygraph mode runs no
AMP on a CPU, and its CPU kernels refuse float16 matmul/conv at build time, so the facts are
bfloat16; the rule itself does not depend on the dtype. Key: (op, input dtype, param dtype,
has bias) -> output dtype; conv2d with a bias is Paddle's Conv2D: conv2d, then its own add.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec import paddle as amp
from mixprec.core.autocast import fp32_region

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# Paddle 3.3.1 (CPU build, PIR static, dtype='bfloat16'); key: level, "_no_promote" suffix for
# use_promote=False.
PADDLE_331 = {
    "O1": {
        ("add", "bfloat16", "bfloat16"): "bfloat16",
        ("add", "bfloat16", "float32"): "float32",
        ("add", "float32", "bfloat16"): "float32",
        ("add", "float32", "float32"): "float32",
        ("conv2d", "bfloat16", "bfloat16", False): "bfloat16",
        ("conv2d", "bfloat16", "bfloat16", True): "bfloat16",
        ("conv2d", "bfloat16", "float32", False): "bfloat16",
        ("conv2d", "bfloat16", "float32", True): "float32",
        ("conv2d", "float32", "bfloat16", False): "bfloat16",
        ("conv2d", "float32", "bfloat16", True): "bfloat16",
        ("conv2d", "float32", "float32", False): "bfloat16",
        ("conv2d", "float32", "float32", True): "float32",
        ("exp", "bfloat16"): "float32",
        ("exp", "float32"): "float32",
        ("matmul", "bfloat16", "bfloat16"): "bfloat16",
        ("matmul", "bfloat16", "float32"): "bfloat16",
        ("matmul", "float32", "bfloat16"): "bfloat16",
        ("matmul", "float32", "float32"): "bfloat16",
        ("mean", "bfloat16"): "float32",
        ("mean", "float32"): "float32",
        ("multiply", "bfloat16", "bfloat16"): "bfloat16",
        ("multiply", "bfloat16", "float32"): "float32",
        ("multiply", "float32", "bfloat16"): "float32",
        ("multiply", "float32", "float32"): "float32",
        ("relu", "bfloat16"): "bfloat16",
        ("relu", "float32"): "float32",
        ("softmax", "bfloat16"): "float32",
        ("softmax", "float32"): "float32",
    },
    "O2": {
        ("add", "bfloat16", "bfloat16"): "bfloat16",
        ("add", "bfloat16", "float32"): "float32",
        ("add", "float32", "bfloat16"): "float32",
        ("add", "float32", "float32"): "float32",
        ("conv2d", "bfloat16", "bfloat16", False): "bfloat16",
        ("conv2d", "bfloat16", "bfloat16", True): "bfloat16",
        ("conv2d", "bfloat16", "float32", False): "bfloat16",
        ("conv2d", "bfloat16", "float32", True): "float32",
        ("conv2d", "float32", "bfloat16", False): "bfloat16",
        ("conv2d", "float32", "bfloat16", True): "bfloat16",
        ("conv2d", "float32", "float32", False): "bfloat16",
        ("conv2d", "float32", "float32", True): "float32",
        ("exp", "bfloat16"): "bfloat16",
        ("exp", "float32"): "float32",
        ("matmul", "bfloat16", "bfloat16"): "bfloat16",
        ("matmul", "bfloat16", "float32"): "bfloat16",
        ("matmul", "float32", "bfloat16"): "bfloat16",
        ("matmul", "float32", "float32"): "bfloat16",
        ("mean", "bfloat16"): "bfloat16",
        ("mean", "float32"): "float32",
        ("multiply", "bfloat16", "bfloat16"): "bfloat16",
        ("multiply", "bfloat16", "float32"): "float32",
        ("multiply", "float32", "bfloat16"): "float32",
        ("multiply", "float32", "float32"): "float32",
        ("relu", "bfloat16"): "bfloat16",
        ("relu", "float32"): "float32",
        ("softmax", "bfloat16"): "bfloat16",
        ("softmax", "float32"): "float32",
    },
    "O2_no_promote": {
        ("add", "bfloat16", "bfloat16"): "bfloat16",
        ("add", "bfloat16", "float32"): "bfloat16",
        ("add", "float32", "bfloat16"): "bfloat16",
        ("add", "float32", "float32"): "bfloat16",
        ("conv2d", "bfloat16", "bfloat16", False): "bfloat16",
        ("conv2d", "bfloat16", "bfloat16", True): "bfloat16",
        ("conv2d", "bfloat16", "float32", False): "bfloat16",
        ("conv2d", "bfloat16", "float32", True): "bfloat16",
        ("conv2d", "float32", "bfloat16", False): "bfloat16",
        ("conv2d", "float32", "bfloat16", True): "bfloat16",
        ("conv2d", "float32", "float32", False): "bfloat16",
        ("conv2d", "float32", "float32", True): "bfloat16",
        ("exp", "bfloat16"): "bfloat16",
        ("exp", "float32"): "bfloat16",
        ("matmul", "bfloat16", "bfloat16"): "bfloat16",
        ("matmul", "bfloat16", "float32"): "bfloat16",
        ("matmul", "float32", "bfloat16"): "bfloat16",
        ("matmul", "float32", "float32"): "bfloat16",
        ("mean", "bfloat16"): "bfloat16",
        ("mean", "float32"): "bfloat16",
        ("multiply", "bfloat16", "bfloat16"): "bfloat16",
        ("multiply", "bfloat16", "float32"): "bfloat16",
        ("multiply", "float32", "bfloat16"): "bfloat16",
        ("multiply", "float32", "float32"): "bfloat16",
        ("relu", "bfloat16"): "bfloat16",
        ("relu", "float32"): "bfloat16",
        ("softmax", "bfloat16"): "bfloat16",
        ("softmax", "float32"): "bfloat16",
    },
    "OD": {
        ("add", "bfloat16", "bfloat16"): "float32",
        ("add", "bfloat16", "float32"): "float32",
        ("add", "float32", "bfloat16"): "float32",
        ("add", "float32", "float32"): "float32",
        ("conv2d", "bfloat16", "bfloat16", False): "bfloat16",
        ("conv2d", "bfloat16", "bfloat16", True): "float32",
        ("conv2d", "bfloat16", "float32", False): "bfloat16",
        ("conv2d", "bfloat16", "float32", True): "float32",
        ("conv2d", "float32", "bfloat16", False): "bfloat16",
        ("conv2d", "float32", "bfloat16", True): "float32",
        ("conv2d", "float32", "float32", False): "bfloat16",
        ("conv2d", "float32", "float32", True): "float32",
        ("exp", "bfloat16"): "float32",
        ("exp", "float32"): "float32",
        ("matmul", "bfloat16", "bfloat16"): "bfloat16",
        ("matmul", "bfloat16", "float32"): "bfloat16",
        ("matmul", "float32", "bfloat16"): "bfloat16",
        ("matmul", "float32", "float32"): "bfloat16",
        ("mean", "bfloat16"): "float32",
        ("mean", "float32"): "float32",
        ("multiply", "bfloat16", "bfloat16"): "float32",
        ("multiply", "bfloat16", "float32"): "float32",
        ("multiply", "float32", "bfloat16"): "float32",
        ("multiply", "float32", "float32"): "float32",
        ("relu", "bfloat16"): "float32",
        ("relu", "float32"): "float32",
        ("softmax", "bfloat16"): "float32",
        ("softmax", "float32"): "float32",
    },
}


def _t(dtype: str, shape: tuple[int, ...] = (4, 4)) -> torch.Tensor:
    return torch.randn(*shape, dtype=DTYPES[dtype])


OPS = {
    "matmul": lambda a, b: _t(a) @ _t(b),
    "add": lambda a, b: _t(a) + _t(b),
    "multiply": lambda a, b: torch.mul(_t(a), _t(b)),
    "conv2d": lambda a, b, bias: F.conv2d(
        _t(a, (1, 1, 6, 6)), _t(b, (2, 1, 3, 3)), _t(b, (2,)) if bias else None
    ),
    "relu": lambda a: F.relu(_t(a)),
    "softmax": lambda a: F.softmax(_t(a), -1),
    "mean": lambda a: _t(a).mean(),
    "exp": lambda a: _t(a).exp(),
}


@pytest.mark.parametrize("key", sorted(PADDLE_331))
def test_output_dtypes_are_paddles(key: str) -> None:
    level, promote = key[:2], not key.endswith("_no_promote")
    got = {}
    with amp.auto_cast(level=level, use_promote=promote, dtype="bfloat16", device_type="cpu"):
        for case in PADDLE_331[key]:
            got[case] = str(OPS[case[0]](*case[1:]).dtype).removeprefix("torch.")
    assert got == PADDLE_331[key]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_an_fp32_conv_bias_is_added_by_its_own_promoted_add(dtype: torch.dtype) -> None:
    """O2 with use_promote over a Conv2d that decorate did not cast: the convolution runs low,
    its fp32 bias is added in fp32 after it (Paddle's Conv2D: conv2d then add). The values are
    the low convolution, widened, plus the bias: exactly, as the reference is the same ops."""
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3)
    x = torch.randn(2, 2, 6, 6)
    with amp.auto_cast(level="O2", dtype=dtype, device_type="cpu"):
        out = conv(x)
    with torch.autocast("cpu", dtype=dtype):
        low = F.conv2d(x, conv.weight)
    assert low.dtype == dtype and out.dtype == torch.float32
    torch.testing.assert_close(out, low.float() + conv.bias.view(-1, 1, 1), rtol=0, atol=0)
    out.sum().backward()
    # the bias gradient is the fp32 sum of ones over batch and space; the weight's is low
    torch.testing.assert_close(conv.bias.grad, torch.full((3,), 2.0 * 4 * 4), rtol=0, atol=0)
    with amp.auto_cast(level="O2", dtype=dtype, use_promote=False, device_type="cpu"):
        assert conv(x).dtype == dtype  # no promote: the add runs low too


@pytest.mark.parametrize(
    "conv", [nn.Conv1d(2, 3, 3), nn.Conv3d(2, 3, 3), nn.ConvTranspose2d(2, 3, 3)]
)
def test_every_biased_conv_is_split(conv: nn.Module) -> None:
    x = torch.randn(1, 2, *([5] * (conv.weight.dim() - 2)))
    with amp.auto_cast(level="O1", dtype="bfloat16", device_type="cpu"):
        assert conv(x).dtype == torch.float32  # O1 promotes the bias add (Paddle's O1 rule)
        assert conv(x[0]).dtype == torch.float32  # unbatched input: the channel dim is first


def test_a_decorated_conv_stays_low_and_an_inner_level_decides() -> None:
    torch.manual_seed(0)
    model = amp.decorate(nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU()), level="O2", dtype="bfloat16")
    x = torch.randn(1, 1, 6, 6)
    with amp.auto_cast(level="O2", dtype="bfloat16", device_type="cpu"):
        assert model(x).dtype == torch.bfloat16  # low bias: the add stays low
    fp32_conv = nn.Conv2d(1, 2, 3)
    with amp.auto_cast(level="O2", dtype="bfloat16", device_type="cpu"):
        with amp.auto_cast(level="O2", dtype="bfloat16", use_promote=False, device_type="cpu"):
            assert fp32_conv(x).dtype == torch.bfloat16  # the inner level (no promote) decides
        assert fp32_conv(x).dtype == torch.float32  # and leaving it restores the outer one
        with fp32_region():
            reference = fp32_conv(x)  # fp32 regions keep torch's fused op
        assert reference.dtype == torch.float32
    torch.testing.assert_close(reference, fp32_conv(x), rtol=0, atol=0)


def test_linear_is_one_white_listed_op_as_paddle_331s_linear_v2() -> None:
    """Paddle 3.3.1 runs nn.Linear as linear_v2 (one op on its white list) where its dygraph
    AMP runs (CUDA builds, FLAGS_use_legacy_linear=0, the default): low at every level, fp32
    bias or not, as torch's F.linear here. Observed: in PIR mode linear_v2's inputs are cast to
    bfloat16 at O1, O2 (either use_promote) and OD. Paddle's CPU build and FLAGS_use_legacy_linear
    split it into matmul + add; Paddle's test_amp_promote.py (written before linear_v2) expects
    that split's float32."""
    lin = nn.Linear(4, 4)
    for level, promote in (("O1", True), ("O2", True), ("O2", False), ("OD", True)):
        with amp.auto_cast(level=level, use_promote=promote, dtype="bfloat16", device_type="cpu"):
            assert lin(torch.randn(2, 4)).dtype == torch.bfloat16, (level, promote)
