"""CUDA C++ sources of lowbit's kernels, installed as the data package ``lowbit._cuda_src``.

Loaded by ``lowbit/_kernels.py`` (cupy.RawModule on GPUs, ``lowbit/_cudasim.py`` on CPUs).
"""
