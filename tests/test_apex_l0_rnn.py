"""Apex's tests/L0/run_amp/test_rnn.py, ported to mixprec (the `amp.init` handle API).

Changes from Apex's file, each for a stated reason: `from mixprec.apex import amp` for
`from apex import amp`; tensors on the `device` fixture's device (CPU by default: torch's
RNN cells and its CPU RNN kernels run in fp16 there, so Apex's fp16 checks run as written)
instead of CUDA; dtype comparisons for Apex's type strings; unittest classes become pytest
functions over a `handle` fixture (setUp's `amp.init(enabled=True)`, tearDown's
`_deactivate()`); Apex's default-tensor-type juggling around pack_padded_sequence is not
needed (nothing sets a CUDA default type); the packed-sequence lengths come from a seeded
torch generator instead of Python's unseeded `random`. Sizes (h=64, b=16, t=10), configs and
the expected dtypes (fp16 outputs, grads in the input's dtype) are Apex's; its skipIfRocm
marks have no counterpart on CPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec.apex import amp

pytestmark = pytest.mark.usefixtures("device")
H, B, T = 64, 16, 10  # Apex's common_init


@pytest.fixture
def handle(device):
    handle = amp.init(enabled=True)
    yield handle
    handle._deactivate()


def run_cell_test(cell, state_tuple=False):
    shape = (B, H)
    for typ in [torch.float, torch.half]:
        xs = [torch.randn(shape, dtype=typ).requires_grad_() for _ in range(T)]

        def hidden_fn(typ=typ):
            return torch.zeros(shape, dtype=typ)

        hidden = (hidden_fn(), hidden_fn()) if state_tuple else hidden_fn()
        outputs = []
        for i in range(T):
            hidden = cell(xs[i], hidden)
            outputs.append(hidden[0] if state_tuple else hidden)
        for y in outputs:
            assert y.dtype == torch.half
        outputs[-1].float().sum().backward()
        for x in xs:
            assert x.grad.dtype == x.dtype


def test_rnn_cell_is_half(handle) -> None:
    run_cell_test(nn.RNNCell(H, H))


def test_gru_cell_is_half(handle) -> None:
    run_cell_test(nn.GRUCell(H, H))


def test_lstm_cell_is_half(handle) -> None:
    run_cell_test(nn.LSTMCell(H, H), state_tuple=True)


def run_rnn_test(rnn, layers, bidir, state_tuple=False):
    for typ in [torch.float, torch.half]:
        x = torch.randn((T, B, H), dtype=typ).requires_grad_()

        def hidden_fn(typ=typ):
            return torch.zeros((layers + (layers * bidir), B, H), dtype=typ)

        hidden = (hidden_fn(), hidden_fn()) if state_tuple else hidden_fn()
        output, _ = rnn(x, hidden)
        assert output.dtype == torch.half
        output[-1, :, :].float().sum().backward()
        assert x.grad.dtype == x.dtype


CONFIGS = [(1, False), (2, False), (2, True)]


def test_rnn_is_half(handle) -> None:
    for layers, bidir in CONFIGS:
        rnn = nn.RNN(H, H, num_layers=layers, nonlinearity="relu", bidirectional=bidir)
        run_rnn_test(rnn, layers, bidir)


def test_gru_is_half(handle) -> None:
    for layers, bidir in CONFIGS:
        run_rnn_test(nn.GRU(H, H, num_layers=layers, bidirectional=bidir), layers, bidir)


def test_lstm_is_half(handle) -> None:
    for layers, bidir in CONFIGS:
        rnn = nn.LSTM(H, H, num_layers=layers, bidirectional=bidir)
        run_rnn_test(rnn, layers, bidir, state_tuple=True)


def test_rnn_packed_sequence(handle) -> None:
    num_layers = 2
    rnn = nn.RNN(input_size=H, hidden_size=H, num_layers=num_layers)
    for typ in [torch.float, torch.half]:
        x = torch.randn((T, B, H), dtype=typ).requires_grad_()
        lens = torch.randint(T // 2, T + 1, (B,), device="cpu").sort(descending=True).values
        packed_seq = nn.utils.rnn.pack_padded_sequence(x, lens)
        hidden = torch.zeros((num_layers, B, H), dtype=typ)
        output, _ = rnn(packed_seq, hidden)
        assert output.data.dtype == torch.half
        output.data.float().sum().backward()
        assert x.grad.dtype == x.dtype


def test_lstm_output_equals_the_hand_cast_fp16_lstm(handle) -> None:
    # mixprec adds: the whitelisted RNN runs exactly the fp16 RNN on fp16 weights and inputs
    rnn = nn.LSTM(H, H, num_layers=2)
    x = torch.randn((T, B, H))
    got, _ = rnn(x)
    handle._deactivate()
    ref = nn.LSTM(H, H, num_layers=2).half()
    ref.load_state_dict({k: v.half() for k, v in rnn.state_dict().items()})
    want, _ = ref(x.half())
    torch.testing.assert_close(got, want, rtol=0, atol=0)
