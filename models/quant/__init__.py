"""Quantized weights: int8/fp16/int4 linear modes, llama.cpp blocks, pre-quantized checkpoints, MXFP4."""
