"""Apex's O1 cast lists (apex/amp/lists/*), as mixprec op names for the op-list autocast.

Apex patched these functions of torch, torch.nn.functional and torch.Tensor; mixprec names
each op once (core/autocast.py normalises spellings: "matmul" is torch.matmul, Tensor.matmul
and `a @ b`; "pow" is also `a ** b`), and `amp.init` hands them to `mixprec.autocast` as its
custom white and black lists. Ops on neither list run as torch's autocast decides; Apex's
promote lists (add, mul, atan2, cat, ...) need no entry: torch's type promotion already
returns the widest input dtype.
"""

from __future__ import annotations

LOW_PRECISION_OPS: frozenset[str] = frozenset(
    {
        # convolutions and the layers' functional forms (weights arrive as arguments)
        *("conv1d", "conv2d", "conv3d", "conv_tbc", "prelu", "linear"),
        *("conv_transpose1d", "conv_transpose2d", "conv_transpose3d"),
        # BLAS (Apex put the batched ones here from CUDA 9.1 on)
        *("addmm", "addmv", "addr", "matmul", "mm", "mv", "addbmm", "baddbmm", "bmm"),
        # Apex's RNN special cases: the cells and the fused multi-layer RNNs run in fp16
        *("rnn_tanh_cell", "rnn_relu_cell", "lstm_cell", "gru_cell"),
        *("rnn_tanh", "rnn_relu", "lstm", "gru"),
    }
)
"""Apex's FP16_FUNCS: floating inputs cast to the low dtype."""

FP32_OPS: frozenset[str] = frozenset(
    {
        # pointwise with a wide range or poor fp16 accuracy
        *("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2"),
        *("reciprocal", "rsqrt", "sinh", "tan", "pow"),
        # reductions
        *("cumprod", "cumsum", "dist", "norm", "prod", "std", "sum", "var", "renorm"),
        # cast up before leaving the device, as Apex did
        "cpu",
        # torch.nn.functional: interpolation, softmax family, normalisation
        *("interpolate", "softplus", "softmin", "log_softmax", "softmax"),
        *("layer_norm", "group_norm", "local_response_norm", "normalize", "cosine_similarity"),
        # losses
        *("poisson_nll_loss", "cosine_embedding_loss", "cross_entropy", "hinge_embedding_loss"),
        *("kl_div", "l1_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss"),
        *("multilabel_soft_margin_loss", "multi_margin_loss", "nll_loss", "smooth_l1_loss"),
        *("binary_cross_entropy_with_logits", "soft_margin_loss", "triplet_margin_loss"),
        # Apex's banned op: fp32 when allow_banned=True; refused on fp16 inputs otherwise
        "binary_cross_entropy",
    }
)
"""Apex's FP32_FUNCS: floating inputs cast to float32."""

BANNED_OPS: dict[str, str] = {
    "binary_cross_entropy": (
        "F.binary_cross_entropy / nn.BCELoss got a low-precision input under amp: the sigmoid "
        "before it ran in low precision, where its output saturates. Use "
        "nn.BCEWithLogitsLoss (sigmoid and loss in one fp32 op), or "
        "amp.register_float_function(torch, 'sigmoid') before amp.init(); if the input is "
        "known to be safe, pass allow_banned=True to amp.init()."
    ),
}
"""Ops Apex refuses on fp16/bf16 inputs unless amp.init(allow_banned=True): op -> message."""

INPLACE_FP32_OPS: frozenset[str] = frozenset(op + "_" for op in FP32_OPS if op != "cpu")
"""In-place forms of the fp32 ops (exp_, pow_, ...): their result would keep self's low dtype,
so Apex raised on a low-precision self instead of computing in it."""
