"""The CPU kernels: each a ``.c`` file shipped as package data, built on first use and cached
(``build.py``), with its ctypes wrapper beside it: ``paged_attention``, ``panel_gemm``,
``fused`` and ``layer_loop``."""
