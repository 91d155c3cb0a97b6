"""Triton kernels of rfattn, installed as ``rfattn.kernels`` (never ``import kernels``).

Only ``@triton.jit`` kernels, their configs and thin launchers live here: no autograd, no random
draws, no imports from ``rfattn``. Submodules are imported lazily by ``rfattn.ops`` and
``rfattn.fused`` so that ``import rfattn`` never touches Triton or a GPU driver.

* ``common``: the feature epilogues shared by every form (GERF family, signed table, rmf),
  loads and the launch setup;
* ``rf_parallel``: non-causal forward and backward (key pass, deterministic merge, query pass);
* ``rf_chunk``: causal, chunkwise, forward and backward, with the carried state;
* ``rf_recurrent``: the decode step (a few tokens against the state, no gradient);
* ``stats``: per-(batch, head) moments for the data-dependent features.
"""
