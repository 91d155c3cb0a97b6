"""Intra-op threads for the torch path's blocked loops on a CPU shared with other work.

Each torch op runs its parallel region on all intra-op threads and waits at its end for the
slowest. When another process keeps a core busy, the thread that shares that core gets a slice of
it, and every region waits for that slice: on this project's 2-core machine with one core busy,
the blocked causal forward at T = 8192 ran 2.8x slower than quiet on 2 threads, but only 1.7x
slower than the quiet 2-thread time on 1 thread (``bench.cpu_backend``'s contention case).

:func:`adaptive` (entered by the blocked forwards and backwards, :mod:`rfattn.blocked`, for CPU
tensors) compares the process's CPU time with the wall time between blocks (:func:`check`, at
each block boundary). When the threads got fewer cores than they are, by more than
:data:`SLACK`, over a window of at least :data:`WINDOW_S`, it lowers torch's intra-op threads to
the cores they got (at least 1) for the rest of the call, and starts the calls of the next
:data:`HOLD_S` seconds there; the first call after that measures at the full count again. The
count is put back when each call ends. Calls shorter than a window never change it, so a quiet
machine keeps all threads whatever the size of the calls.

It changes ``torch.set_num_threads`` for the duration of a call: process-wide for MKL, so a
second thread of the process running torch ops at that moment runs its matrix products on the
lowered count too. ``ENABLED = False`` turns it off.
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch

__all__ = ["adaptive", "check", "ENABLED", "WINDOW_S", "HOLD_S", "SLACK"]

#: False: always run on torch's configured thread count
ENABLED = True
#: the shortest wall time (seconds) a measurement covers
WINDOW_S = 0.02
#: how long (seconds) a lowered count starts the next calls
HOLD_S = 1.0
#: cores missing (threads minus the cores the process got) that count as contention
SLACK = 0.35

# the clocks (tests replace them)
_wall = time.perf_counter
_cpu = time.process_time


class _State(threading.local):
    def __init__(self):
        self.active = False
        self.full = 1
        self.measuring = False
        self.t_wall = self.t_cpu = 0.0


_state = _State()
_hold = {"until": float("-inf"), "threads": 0}


@contextlib.contextmanager
def adaptive(device: torch.device):
    """Let :func:`check` lower the intra-op thread count within (module docstring); a no-op
    for non-CPU devices, under ``torch.compile``, nested, with one thread or ``ENABLED`` off."""
    full = torch.get_num_threads()
    if (
        _state.active
        or not ENABLED
        or full <= 1
        or torch.device(device).type != "cpu"
        or torch.compiler.is_compiling()
    ):
        yield
        return
    _state.active, _state.full = True, full
    held = _hold["threads"] if _wall() < _hold["until"] else 0
    if 0 < held < full:
        torch.set_num_threads(held)
        _state.measuring = False
    else:
        _start()
    try:
        yield
    finally:
        _state.active = _state.measuring = False
        if torch.get_num_threads() != full:
            torch.set_num_threads(full)


def _start() -> None:
    _state.measuring = True
    _state.t_wall, _state.t_cpu = _wall(), _cpu()


def check() -> None:
    """A block boundary inside :func:`adaptive`: once the current window is long enough, compare
    the cores the process got with the threads and lower the count where they fell short."""
    if not _state.measuring:
        return
    wall = _wall() - _state.t_wall
    if wall < WINDOW_S:
        return
    cores = (_cpu() - _state.t_cpu) / wall
    full = _state.full
    if cores < full - SLACK:
        threads = max(1, min(full - 1, int(cores + 0.5)))
        torch.set_num_threads(threads)
        _hold["until"], _hold["threads"] = _wall() + HOLD_S, threads
        _state.measuring = False
    else:
        _start()
