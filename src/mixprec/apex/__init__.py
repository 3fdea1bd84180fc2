"""Apex's face on mixprec: `from mixprec.apex import amp` (pure PyTorch, no CUDA extension)."""
