"""Every torch op of a call, counted by name through a dispatch mode, and sorted by what it would
cost on a GPU (shared by ``python -m bench.host`` and ``tests/test_host_path.py``).

rfattn's operators (``torch.ops.rfattn.*``) are opaque to a dispatch mode: it sees the operator,
not the ops its body issues. :class:`OpCounter` counts the operator and then runs its body where
the mode sees it, by redispatching it to its CPU kernel (the same body every device runs).

Kinds (:func:`kind`):

* ``copy``: a tensor made from host data (``aten.lift_fresh``: what ``torch.tensor(...)`` and an
  item assignment of a number issue); on CUDA a host-to-device copy that waits on the host.
* ``sync``: the host reads a tensor (``_local_scalar_dense``: ``.item()``, ``int()``,
  ``bool()``), or an op whose output size depends on the data (``nonzero``,
  ``repeat_interleave`` without ``output_size``...), or ``equal``: on CUDA each stalls the host
  until the GPU has caught up.
* ``view``: metadata only (a view, ``detach``, ``_unsafe_view``...): no GPU work.
* ``alloc``: an uninitialised allocation (``empty``...): the caching allocator, no GPU work.
* ``operator``: one of rfattn's operators (its body's ops are counted too).
* ``gpu``: everything else: a kernel on the GPU (a fill, a copy, a reduction, arithmetic).
"""

from __future__ import annotations

import collections
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

COPIES = {"lift_fresh"}
SYNCS = {"_local_scalar_dense", "is_nonzero", "nonzero", "equal", "masked_select", "unique",
         "_unique2", "bincount", "repeat_interleave (sized by the data)"}  # fmt: skip
ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
               "empty_permuted"}  # fmt: skip
#: metadata-only ops whose schema is not an alias (so ``OpOverload.is_view`` is False)
METADATA = {"_unsafe_view", "_reshape_alias", "sym_size", "sym_stride", "sym_numel",
            "sym_storage_offset", "resize_", "set_"}  # fmt: skip
NAMESPACES = ("rfattn",)


def kind(name: str, func=None) -> str:
    """The kind of an op (module docstring) from its counted name and, if given, its overload."""
    if name in COPIES:
        return "copy"
    if name in SYNCS:
        return "sync"
    if name in ALLOCATIONS:
        return "alloc"
    if name in METADATA or (func is not None and func.is_view):
        return "view"
    if func is not None and func.namespace in NAMESPACES:
        return "operator"
    return "gpu"


class OpCounter(TorchDispatchMode):
    """Counts every op by name (``ops``) and remembers each name's kind (``kinds``); rfattn's
    operators run their bodies under this mode too. ``timed``: also add up the wall time spent
    inside the ops of these kinds, by name (``seconds``: their CPU kernels as they ran in the
    call, with the dispatch below this mode)."""

    def __init__(self, timed: tuple[str, ...] = ()):
        super().__init__()
        self.ops = collections.Counter()
        self.kinds: dict[str, str] = {}
        self.timed = timed
        self.seconds: dict[str, float] = collections.defaultdict(float)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if name == "repeat_interleave" and kwargs.get("output_size") is None and \
                func.__name__ != "repeat_interleave.self_int":  # fmt: skip
            name = "repeat_interleave (sized by the data)"
        self.ops[name] += 1
        self.kinds.setdefault(name, kind(name, func))
        if func.namespace in NAMESPACES:  # run the operator's body where this mode sees it
            with self:
                return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args,
                                       **kwargs)  # fmt: skip
        if self.kinds[name] not in self.timed:
            return func(*args, **kwargs)
        start = time.perf_counter()
        try:
            return func(*args, **kwargs)
        finally:
            self.seconds[name] += time.perf_counter() - start

    def of_kind(self, *kinds: str) -> dict[str, int]:
        """``{name: count}`` of the ops of these kinds, most frequent first."""
        return {n: c for n, c in self.ops.most_common() if self.kinds[n] in kinds}

