"""Quantized weights: the linear layers' int8/fp16 kernels and MXFP4 experts."""
