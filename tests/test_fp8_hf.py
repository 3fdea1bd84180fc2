"""fp8 on Hugging Face layers: transformers' Conv1D (GPT-2) converted in place, exactly as a Linear.

Models are built from a config (no download, no weights): HF_HUB_OFFLINE=1 is set by the test.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from mixprec.fp8 import Float8Conv1D, Float8Linear, convert_to_fp8, fp8_summary

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device")

transformers = pytest.importorskip("transformers")  # the dev extra installs it
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # from config only: nothing is fetched
from transformers.pytorch_utils import Conv1D  # noqa: E402


@pytest.mark.host_only
def test_import_mixprec_gives_fp8() -> None:
    # a fresh interpreter: in this one the test's own imports already loaded mixprec.fp8
    code = "import mixprec; print(mixprec.fp8.convert_to_fp8.__name__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "convert_to_fp8", done.stderr


def test_conv1d_matches_float8_linear_on_the_transposed_weight_exactly() -> None:
    torch.manual_seed(0)
    conv = Conv1D(nf=48, nx=32)  # weight (in=32, out=48), forward x @ weight + bias
    nn.init.normal_(conv.bias)
    weight = conv.weight
    model = convert_to_fp8(nn.Sequential(conv))
    layer = model[0]
    assert isinstance(layer, Float8Conv1D) and fp8_summary(model).converted == ("0",)
    assert layer.weight is weight and layer.weight.shape == (32, 48) and layer.nf == 48
    assert list(model.state_dict()) == ["0.weight", "0.bias"]  # Conv1D's keys and shapes
    ref = Float8Linear.from_float(nn.Linear(32, 48))
    with torch.no_grad():
        ref.weight.copy_(weight.t())
        ref.bias.copy_(conv.bias)
    x = torch.randn(2, 5, 32)
    x_ref = x.clone().requires_grad_()
    x.requires_grad_()
    out, want = layer(x), ref(x_ref)
    # exact: the same values reach the same float8 casts and GEMMs; only the storage differs
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    out.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad.t(), rtol=0, atol=0)
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad, rtol=0, atol=0)


def test_conv1d_off_alignment_is_named_with_its_reason() -> None:
    model = convert_to_fp8(nn.Sequential(Conv1D(nf=10, nx=32)))
    assert type(model[0]) is Conv1D
    assert "out_features=10" in fp8_summary(model).skipped["0"]


def test_gpt2_converts_every_conv1d_and_the_tied_head() -> None:
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    model = convert_to_fp8(model)
    summary = fp8_summary(model)
    conv_names = [
        f"transformer.h.{i}.{n}"
        for i in range(2)
        for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    ]
    assert sorted(summary.converted) == sorted([*conv_names, "lm_head"])
    assert summary.skipped == {}  # nothing Linear-like stays behind silently
    assert all(isinstance(model.get_submodule(n), Float8Conv1D) for n in conv_names)
    assert model.lm_head.weight is model.transformer.wte.weight  # the tie survives
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes
    ids = torch.randint(0, 64, (2, 8))
    out = model(input_ids=ids, labels=ids)
    assert isinstance(out, transformers.modeling_outputs.CausalLMOutputWithCrossAttentions)
    out.loss.backward()
    assert model.transformer.h[0].attn.c_attn.weight.grad.shape == (32, 96)


def test_summary_is_found_through_convert_to_amp_s_wrapper() -> None:
    import mixprec

    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped, _, _ = mixprec.convert_to_amp(model, optimizer, None, "fp8")
    summary = fp8_summary(wrapped)  # the PrecisionModule holds the converted model
    assert summary.converted == ("0",) and "out_features=10" in summary.skipped["2"]
