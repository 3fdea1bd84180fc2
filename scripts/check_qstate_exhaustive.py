"""Check mixprec.core.qstate's nearest-code table against torchao's quantize on every fp32
value in [-1, 1] and its negatives (2**31 values per map), for torchao's four code maps
(int8 / int4, signed / unsigned), and its fp8 conversion against torch's own on every fp32
value (2**32; on a torch that does not saturate, as 2.11, where the two agree: below 464 in
magnitude, and nan). Not in CI: ~8 min on 2 cores (in chunks of 2**24).
tests/test_qstate.py checks every step point, its neighbours and every bucket's ends, and
fp8's rounding boundaries; this is the exhaustive version of it.

    python scripts/check_qstate_exhaustive.py
"""

from __future__ import annotations

import sys
import time

import torch
from torchao.optim.quant_utils import quantize_4bit_with_qmap, quantize_8bit_with_qmap

from mixprec.core import qstate
from mixprec.core.lean import new_state

CHUNK = 1 << 24
ONE = 0x3F800000  # the bits of 1.0: every non-negative fp32 up to it is below


def check(fmt: str, signed: bool) -> int:
    """Mismatching values for one code map (prints the count and the time)."""
    state = new_state(torch.empty(4096), fmt, signed)
    qmap = state.qmap
    table = qstate.table(qmap, type(state).__name__, signed)
    search = quantize_8bit_with_qmap if fmt == "int8" else quantize_4bit_with_qmap
    theirs = torch.compile(lambda x: search(x, qmap).int(), dynamic=False)
    mine = torch.compile(lambda x: qstate.nearest_codes(x, table), dynamic=False)
    start, bad, n = time.perf_counter(), 0, 0
    for sign in (0, 1 << 31):
        for first in range(0, ONE + 1, CHUNK):
            bits = torch.arange(first, first + CHUNK, dtype=torch.int64).clamp(max=ONE) | sign
            bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)
            x = bits.view(torch.float32)
            bad += int((theirs(x) != mine(x)).sum())
            n += CHUNK
    kind = "signed" if signed else "unsigned"
    print(f"{fmt} {kind}: {n:.3e} values, {bad} mismatches, {time.perf_counter() - start:.0f} s")
    return bad


def check_fp8() -> int:
    """Mismatching fp8 codes (qstate.fp8_codes against torch's .to(float8_e4m3fn)) over
    every fp32 value (prints the count and the time)."""
    saturates = bool(torch.tensor(1e6).to(torch.float8_e4m3fn).float() == qstate.FP8_MAX)
    mine = torch.compile(qstate.fp8_codes, dynamic=False)
    start, bad = time.perf_counter(), 0
    for first in range(-(1 << 31), 1 << 31, CHUNK):
        x = torch.arange(first, first + CHUNK, dtype=torch.int64).to(torch.int32)
        x = x.view(torch.float32)
        theirs = x.to(torch.float8_e4m3fn).view(torch.uint8).int()
        wrong = theirs != (mine(x) & 0xFF)
        if not saturates:
            wrong &= (x.abs() < 464) | x.isnan()
        bad += int(wrong.sum())
    print(f"fp8: 2**32 values, {bad} mismatches, {time.perf_counter() - start:.0f} s")
    return bad


def main() -> int:
    maps = [("int8", True), ("int8", False), ("int4", True), ("int4", False)]
    bad = sum(check(fmt, signed) for fmt, signed in maps)
    return 1 if bad + check_fp8() else 0


if __name__ == "__main__":
    sys.exit(main())
