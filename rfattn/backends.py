"""One process's attention: the fused kernels (:mod:`rfattn.fused`) or the torch path
(:mod:`rfattn.torch_path`), for the sharded path's local pass (:mod:`rfattn.distributed`);
:func:`rfattn.rf_attention` makes the same choice (``call.runs_fused``) without this hop. The
hybrid (window and sinks) has its own choice, :func:`hybrid`, for both."""

from __future__ import annotations

from rfattn import fused, torch_path
from rfattn import hybrid as hybrid_path
from rfattn.call import Call, runs_fused

__all__ = ["attend", "hybrid"]


def attend(call: Call):
    """``out`` (or ``(out, state)`` with ``return_state``) of a call in one process (no group; a
    non-causal grouped-query call as rows, :meth:`Call.as_rows`): the fused kernels where
    ``call.fused``, else the torch path."""
    return fused.attend(call) if call.fused else torch_path.attend(call)


def hybrid(call: Call):
    """A one-process hybrid call (window, sinks; the sharded hybrid's local pass too): the fused
    hybrid where the backend runs the fused kernels and :func:`fused.hybrid_reason` finds
    nothing against it (``backend="triton"`` raises naming it), else the torch path's
    (:func:`rfattn.hybrid.attend`; also where the operators would run their torch kernels:
    :func:`fused.hybrid_in_torch`)."""
    if call.q.shape[2] and runs_fused(call.q, call.rf, call.causal, call.backend) and \
            not fused.hybrid_in_torch(call):  # fmt: skip
        reason = fused.hybrid_reason(call)
        if reason is None:
            return fused.hybrid(call)
        if call.backend == "triton":
            raise NotImplementedError(f"{reason}; use backend='torch' or 'auto'")
    return hybrid_path.attend(call)
