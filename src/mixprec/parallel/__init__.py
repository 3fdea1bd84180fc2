"""Parallelism under every precision mode: ZeRO-1/2 (zero), data sharding (data), the
pipeline (pipeline/). Imports only mixprec.core and mixprec.fp8 (tests/test_layering.py)."""
