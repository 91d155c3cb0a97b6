"""Kept buffers for the torch path's largest per-block products (the CPU backend).

The blocked torch path (:mod:`rfattn.blocked`) computes each block's projections ``x W^T`` and
chunk states into new tensors of the same few shapes, block after block and call after call.
glibc's default malloc hands such multi-MiB buffers back to the kernel when they are freed, so
every block faulted their pages in again: ``bench.allocator`` measured 9,000 to 35,000 minor page
faults per causal forward at T = 1024 to 4096 and a 1.6-1.7x slower call than with a caching
allocator.

Inside :func:`blocks` (entered for each block by the blocked forwards and backwards) those
products, and in the backward the features and their cotangents, are written into buffers kept
here instead (:func:`buffer`), one per role, ordinal within the block (each :func:`blocks`
starts the ordinals again), shape, dtype and device, reused by the next block and the next
call. The code that
takes them drops a block's tensors before the next block starts, and nothing a call returns
aliases a buffer. Only CPU tensors outside autograd (or in a product that records its own
backward, :func:`keeps`) and outside ``torch.compile`` use them; the buffers are per thread, at
most :data:`MAX_BYTES` per thread (least recently used dropped first; a call split over worker
threads, :func:`rfattn.threads.over_heads`, keeps each part's buffers in its worker), and
:func:`clear` releases those of every thread.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import OrderedDict

import torch

__all__ = ["blocks", "keeps", "buffer", "product", "clear", "kept_bytes", "MAX_BYTES"]

#: the most bytes kept per thread (a default-sized block's products are about 20 MiB)
MAX_BYTES = 128 << 20
#: False: never keep buffers (every product a new tensor, as outside :func:`blocks`)
ENABLED = True


class _Kept:
    """One thread's kept buffers (by key, the most recently used last) and their bytes."""

    def __init__(self):
        self.buffers: OrderedDict = OrderedDict()
        self.bytes = 0


#: every live thread's :class:`_Kept` (a thread's goes when the thread ends)
_all_kept: weakref.WeakSet = weakref.WeakSet()
_all_lock = threading.Lock()


class _State(threading.local):
    def __init__(self):
        self.active = 0
        self.counts: dict = {}
        self.kept = _Kept()
        with _all_lock:
            _all_kept.add(self.kept)


state = _State()


@contextlib.contextmanager
def blocks():
    """Let :func:`buffer` hand out kept buffers within (one block of the blocked loops: the
    previous block's buffers may be handed out again)."""
    state.active += 1
    state.counts.clear()
    try:
        yield
    finally:
        state.active -= 1
        state.counts.clear()


def keeps(device: torch.device) -> bool:
    """Whether :func:`buffer` hands out buffers for ``device`` once autograd is not recording:
    inside :func:`blocks`, not compiling, a CPU device and ``ENABLED``. (A product that records
    its own backward, such as :func:`rfattn.features.project` in the blocked backward, asks this
    and then takes its buffer with recording off.)"""
    return bool(
        state.active
        and ENABLED
        and (device.type if isinstance(device, torch.device) else torch.device(device).type)
        == "cpu"
        and not torch.compiler.is_compiling()
    )


def buffer(role: str, shape, dtype: torch.dtype, device: torch.device,
           new: bool = False) -> torch.Tensor | None:  # fmt: skip
    """A kept, uninitialised ``shape`` buffer for this block's next product of ``role`` (each
    request within a block gets its own), or where none is kept (outside :func:`blocks`, while
    autograd records, under ``torch.compile``, for non-CPU tensors or with ``ENABLED`` off)
    None, or with ``new`` a new uninitialised tensor. The caller writes it fully (``out=``) and
    drops it before the next block."""
    if torch.is_grad_enabled() or not keeps(device):
        return torch.empty(tuple(shape), dtype=dtype, device=device) if new else None
    n = state.counts.get(role, 0)
    state.counts[role] = n + 1
    key = (role, n, tuple(shape), dtype, torch.device(device))
    kept = state.kept
    buf = kept.buffers.pop(key, None)
    if buf is None:
        # a normal tensor even under inference mode: an inference tensor could not be written
        # in place by a later call outside it
        with torch.inference_mode(False):
            buf = torch.empty(tuple(shape), dtype=dtype, device=device)
        kept.bytes += buf.nbytes
    kept.buffers[key] = buf  # the most recently used last
    while kept.bytes > MAX_BYTES and len(kept.buffers) > 1:
        _, old = kept.buffers.popitem(last=False)
        kept.bytes -= old.nbytes
    return buf


def product(a: torch.Tensor, b: torch.Tensor, role: str) -> torch.Tensor:
    """``a @ b`` (leading dims broadcast), written to a kept buffer of ``role`` where
    :func:`buffer` gives one (never while autograd records), else a new tensor."""
    la, lb = a.shape[:-2], b.shape[:-2]
    lead = la if la == lb or not lb else torch.broadcast_shapes(la, lb)  # (the usual cases first)
    shape = (*lead, a.shape[-2], b.shape[-1])
    return torch.matmul(a, b, out=buffer(role, shape, a.dtype, a.device))


def _every_thread() -> list:
    with _all_lock:
        return list(_all_kept)


def clear() -> None:
    """Release the kept buffers of every thread (the caller's and those of the worker threads
    that run a call's heads, :func:`rfattn.threads.over_heads`). Call it while no blocked call
    runs."""
    for kept in _every_thread():
        kept.buffers.clear()
        kept.bytes = 0


def kept_bytes() -> int:
    """Bytes of the kept buffers of every thread."""
    return sum(kept.bytes for kept in _every_thread())
