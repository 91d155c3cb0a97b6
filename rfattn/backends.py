"""One process's attention: the fused kernels (:mod:`rfattn.fused`) or the torch path
(:mod:`rfattn.torch_path`), for the sharded path's local pass (:mod:`rfattn.distributed`);
:func:`rfattn.rf_attention` makes the same choice (``call.runs_fused``) without this hop."""

from __future__ import annotations

from rfattn import fused, torch_path
from rfattn.call import Call

__all__ = ["attend"]


def attend(call: Call):
    """``out`` (or ``(out, state)`` with ``return_state``) of a call in one process (no group; a
    non-causal grouped-query call as rows, :meth:`Call.as_rows`): the fused kernels where
    ``call.fused``, else the torch path."""
    return fused.attend(call) if call.fused else torch_path.attend(call)
