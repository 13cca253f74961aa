"""Quantized weights: int8/fp16/int4 linear modes, llama.cpp block formats and quantizers, AWQ/GPTQ/compressed-tensors checkpoints, MXFP4 experts."""
