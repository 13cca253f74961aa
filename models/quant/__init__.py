"""Quantized weights: the linear layers' int8/fp16/int4 modes (linear.py), llama.cpp's block formats and their
quantizers (block_formats.py, block_quantize.py), AWQ / GPTQ / compressed-tensors checkpoints mapped onto blocks
(prequantized.py, packed_int4.py), and MXFP4 experts (mxfp4.py)."""
