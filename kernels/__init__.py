"""Triton kernels of rfattn, installed as ``rfattn.kernels`` (never ``import kernels``).

Only ``@triton.jit`` kernels, their configs and thin launchers live here: no autograd, no random
draws, no imports from ``rfattn``. Submodules are imported lazily by ``rfattn.autograd`` so that
``import rfattn`` never touches Triton or a GPU driver.

* ``rf_parallel``: non-causal fused forward (key pass, deterministic merge, query pass).
"""
