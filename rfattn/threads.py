"""Intra-op threads for the torch path's blocked loops on a CPU shared with other work.

Each torch op runs its parallel region on all intra-op threads and waits at its end for the
slowest. When another process keeps a core busy, the thread that shares that core gets a slice of
it, and every region waits for that slice: on this project's 2-core machine with one core busy,
the blocked causal forward at T = 8192 ran 3.4x slower than quiet on 2 threads, and 1.76x with
this module lowering them to 1 (``bench.cpu_backend``'s contention case, README).

:func:`adaptive` (entered by the blocked forwards and backwards, :mod:`rfattn.blocked`, for CPU
tensors) compares the process's CPU time with the wall time between blocks (:func:`check`, at
each block boundary), over windows of at least :data:`WINDOW_S`. When the threads got fewer
cores than they are, by more than :data:`SLACK`, in two windows in a row, it lowers torch's
intra-op threads to the cores they got (at least 1) for the rest of the call, and starts the
calls of the next :data:`HOLD_S` seconds there; the first call after that measures at the full
count again. The count is put back when each call ends. Not measured: the whole of the
process's first call (libraries initialise then, on one thread: measured, the first call looked
like contention); one short window alone (a call's set-up, a page-fault burst) decides nothing.
So calls shorter than two windows never change it, and a quiet machine keeps all threads
whatever the size of the calls (measured here at T = 512 to 8192, both modes).

It changes ``torch.set_num_threads`` for the duration of a call: process-wide for MKL, so a
second thread of the process running torch ops at that moment runs its matrix products on the
lowered count too. A library should not change process-wide state behind its caller's back, so
it is off unless asked for (:data:`ENABLED`, ``RFATTN_ADAPTIVE_THREADS=1``); ``bench.cpu_backend``
turns it on, as its committed runs had it.

A large call is not left to that: :func:`over_heads` runs its heads in contiguous parts, one
per intra-op thread, each on a worker thread with one intra-op thread of its own, so no op
waits at a barrier for a thread on a busy core (:func:`split_heads` says when;
``HEADS_ENABLED = False`` turns it off). The adaptation then has nothing to lower: it acts on
the calls that are not split (small ones, per-head feature parameters, one head).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import torch

__all__ = [
    "adaptive",
    "check",
    "ENABLED",
    "WINDOW_S",
    "HOLD_S",
    "SLACK",
    "split_heads",
    "head_parts",
    "over_heads",
    "HEADS_ENABLED",
    "HEADS_MIN_ELEMENTS",
]

#: True: adapt the thread count during a call (it changes ``torch.set_num_threads``, a process-wide
#: setting, while the call runs), so it is opt-in: ``RFATTN_ADAPTIVE_THREADS=1`` in the
#: environment, or set this; False (default): always run on torch's configured thread count
ENABLED = os.environ.get("RFATTN_ADAPTIVE_THREADS", "0") == "1"
#: the shortest wall time (seconds) a measurement covers
WINDOW_S = 0.02
#: how long (seconds) a lowered count starts the next calls
HOLD_S = 3.0
#: cores missing (threads minus the cores the process got) that count as contention
SLACK = 0.35

# the clocks (tests replace them)
wall_clock = time.perf_counter
cpu_clock = time.process_time


class _State(threading.local):
    def __init__(self):
        self.active = False
        self.full = 1
        self.measuring = False
        self.strikes = 0
        self.t_wall = self.t_cpu = 0.0


_state = _State()
hold_until = {"until": float("-inf"), "threads": 0}
#: whether a call has completed in this process (its first call is never measured)
warm = {"done": False}


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
    _state.active, _state.full, _state.strikes = True, full, 0
    held = hold_until["threads"] if wall_clock() < hold_until["until"] else 0
    _state.measuring = False
    if 0 < held < full:
        torch.set_num_threads(held)
    elif warm["done"]:
        _start()
    try:
        yield
    finally:
        _state.active = _state.measuring = False
        warm["done"] = True
        if torch.get_num_threads() != full:
            torch.set_num_threads(full)


def _start() -> None:
    _state.measuring = True
    _state.t_wall, _state.t_cpu = wall_clock(), cpu_clock()


def check() -> None:
    """A block boundary inside :func:`adaptive`: once the current window is long enough, compare
    the cores the process got with the threads, and lower the count where they fell short in
    this window and the one before (module docstring)."""
    if not _state.measuring:
        return
    wall = wall_clock() - _state.t_wall
    if wall < WINDOW_S:
        return
    cores = (cpu_clock() - _state.t_cpu) / wall
    full = _state.full
    _state.strikes = _state.strikes + 1 if cores < full - SLACK else 0
    if _state.strikes >= 2:
        threads = max(1, min(full - 1, int(cores + 0.5)))
        torch.set_num_threads(threads)
        hold_until["until"], hold_until["threads"] = wall_clock() + HOLD_S, threads
        _state.measuring = False
    else:
        _start()


# ------------------------------------------------------------------------------------------------
# heads in parallel

#: False: never split a call's heads over worker threads (:func:`over_heads` runs them at once)
HEADS_ENABLED = True
#: the least work (query rows x tokens x features) a call needs to be split over threads
HEADS_MIN_ELEMENTS = 1 << 21

worker_pool: dict = {"executor": None, "workers": 0}
pool_lock = threading.Lock()


def _forget_pool() -> None:
    # a forked child has none of its parent's worker threads (an executor that believes it has
    # them never runs a task) and may hold a copy of a lock taken in the parent: start afresh
    global pool_lock
    pool_lock = threading.Lock()
    worker_pool["executor"], worker_pool["workers"] = None, 0


os.register_at_fork(after_in_child=_forget_pool)


def _one_thread(barrier) -> None:
    # torch sets a thread's counts once, lazily, from the count last passed to
    # torch.set_num_threads anywhere: have it do so first (reading the count does, and opens
    # no parallel region), or that would undo the count set here. A parallel op in its place
    # (as before) opened a region of the full count, giving this worker an OpenMP team of its
    # own, whose idle threads then stalled every parallel region of the caller's thread for as
    # long as the pool lived (after any call split over the heads, small products of the whole
    # process, the model's own layers included, ran 5-8x slower on 2 cores: measured)
    torch.get_num_threads()
    torch.set_num_threads(1)  # this worker's OpenMP and MKL counts (thread-local)
    barrier.wait()  # every worker starts (and sets its count) before the pool is used


def _executor(workers: int):
    """The worker threads, ``workers`` of them, each running torch ops on one intra-op thread
    (created on first use and again when torch's thread count changes)."""
    from concurrent.futures import ThreadPoolExecutor

    with pool_lock:
        if worker_pool["workers"] != workers:
            if worker_pool["executor"] is not None:
                worker_pool["executor"].shutdown(wait=True)
            full = torch.get_num_threads()
            ex = ThreadPoolExecutor(workers, thread_name_prefix="rfattn-heads")
            barrier = threading.Barrier(workers)
            list(ex.map(lambda _: _one_thread(barrier), range(workers)))
            # torch.set_num_threads also records the count that threads starting later take
            # up: put the caller's back (its own count is unchanged)
            torch.set_num_threads(full)
            worker_pool["executor"], worker_pool["workers"] = ex, workers
        return worker_pool["executor"]


def split_heads(device, heads: int, elements: int) -> bool:
    """Whether a blocked call over ``heads`` independent heads and ``elements`` (query rows x
    tokens x features) of work runs its heads on worker threads (:func:`over_heads`): a CPU
    call outside ``torch.compile`` and CPU autocast, with more than one intra-op thread, more
    than one head, enough work, from a thread that is not itself a worker, ``HEADS_ENABLED``."""
    return bool(
        HEADS_ENABLED
        and heads > 1
        and elements >= HEADS_MIN_ELEMENTS
        and torch.device(device).type == "cpu"
        and torch.get_num_threads() > 1
        and not torch.compiler.is_compiling()
        and not torch.is_autocast_enabled("cpu")
        and not threading.current_thread().name.startswith("rfattn-heads")
    )


def head_parts(heads: int, split: bool) -> list[tuple[int, int]]:
    """The heads ``[h0, h1)`` of each part of a call: one per worker thread (torch's intra-op
    count), contiguous and as even as can be, when ``split`` (:func:`split_heads`); else all
    of them at once."""
    n = min(heads, torch.get_num_threads()) if split else 1
    bounds = [heads * i // n for i in range(n + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def over_heads(fn, parts: list[tuple[int, int]]) -> list:
    """``[fn(h0, h1) for h0, h1 in parts]`` (:func:`head_parts`), each part on a worker thread
    that runs its torch ops on one intra-op thread when there is more than one part.

    Every op of a blocked call runs its parallel region on all intra-op threads and waits for
    the slowest at its end (some 40 regions per block); on a shared or noisy CPU each wait
    stalls. Heads are independent, so each worker runs its heads' whole call instead, one
    thread per core, with one wait at the end; each part's ops are as batched as the call's
    (a part is a contiguous range of heads). The workers run in the caller's grad and
    inference modes."""
    if len(parts) == 1:
        return [fn(*parts[0])]
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def task(bounds):
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return fn(*bounds)

    from concurrent.futures import wait

    ex = _executor(torch.get_num_threads())
    futures = [ex.submit(task, b) for b in parts]
    wait(futures)  # every part done (writing into the caller's tensors) before any error is raised
    return [f.result() for f in futures]
