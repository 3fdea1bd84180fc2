"""The engine: one policy, one scaler rule per scaler, one optimizer step sequence.

Every face (the Colossal-AI mirror at the top level, mixprec.apex, mixprec.paddle,
mixprec.integrations) translates its own words into a Policy and calls in here; parallel/
and mixprec.fp8 build on it. This package imports nothing else from mixprec (mixprec.fp8 hands
its model converter in: core.prepare.register_fp8_converter); tests/test_layering.py holds
that as a path rule.
"""
