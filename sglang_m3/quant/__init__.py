"""Quantized M3 checkpoints: MXFP8 numerics, the checkpoint format, dequantize-at-load (see README.md)."""
