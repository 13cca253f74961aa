"""The native library: C++ sources (decode step, block kernels) and how they are built and loaded."""
