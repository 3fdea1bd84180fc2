"""Colossal-AI's `colossalai.quantization`: fp8 casts, fp8-compressed collectives and
communication hooks, and the fp8 linear, for use outside the Booster.

The names live in `mixprec.quantization.fp8`, as they do in `colossalai.quantization.fp8`.
Colossal's package root exports its bitsandbytes quantization (`BnbQuantizationConfig`,
`quantize_model`), which mixprec does not provide.
"""
