"""Autograd helpers (for the fused operators' eager Functions, :mod:`rfattn.ops`): nothing here
imports the rest of rfattn.

:func:`apply` runs a ``torch.autograd.Function`` as ``Function.apply`` does, minus the Python
wrapper's per-argument work where it has nothing to do. ``Function.apply`` walks every argument
to unwrap functorch tensors of finished transforms (``torch._functorch.utils.
unwrap_dead_wrappers``) before it enters the C++ ``apply``: for a Function of 20 arguments (the
causal operator's) 13.8 µs against 9.1 through the C++ ``apply`` on this project's CPU (timeit,
one thread). Such wrappers exist only where a functorch transform (``torch.func.grad``, ``vmap``,
``vjp``...) made them; with no transform active, a call that reaches rfattn with one is a tensor
leaked out of a finished transform, which rfattn's Functions do not take (they have no
``setup_context``, so under any transform ``Function.apply`` refuses them, and :func:`apply` then
takes that path, error included). The torch path's Functions take a few arguments each and keep
``Function.apply``."""

from __future__ import annotations

import torch

__all__ = ["apply"]

#: torch's own test in ``Function.apply`` (a private function; where a torch release lacks it,
#: every call takes ``Function.apply``)
_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: True)


def apply(function: type[torch.autograd.Function], *args):
    """``function.apply(*args)`` (positional arguments only): the C++ apply directly where no
    functorch transform is active, else ``Function.apply`` itself."""
    if _transforms_active():
        return function.apply(*args)
    return super(torch.autograd.Function, function).apply(*args)
