"""rfattn.threads: the blocked loops lower torch's intra-op threads when the process gets fewer
cores than it runs threads, and put them back. The clocks are replaced by counters here, so each
case sets exactly the wall and CPU time a window measures."""

import os

import pytest
import torch

import rfattn
from rfattn import threads
from rfattn.testing import rel_rms, tolerance


class Clocks:
    def __init__(self):
        self.wall = self.cpu = 0.0

    def advance(self, wall: float, cores: float) -> None:
        self.wall += wall
        self.cpu += wall * cores


@pytest.fixture
def clocks(monkeypatch):
    c = Clocks()
    monkeypatch.setattr(threads, "wall_clock", lambda: c.wall)
    monkeypatch.setattr(threads, "cpu_clock", lambda: c.cpu)
    monkeypatch.setattr(threads, "hold_until", {"until": float("-inf"), "threads": 0})
    monkeypatch.setattr(threads, "warm", {"done": True})
    monkeypatch.setattr(threads, "ENABLED", True)
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield c
    torch.set_num_threads(before)


CPU = torch.device("cpu")
W = threads.WINDOW_S * 1.25  # a full window (exactly WINDOW_S may round below it)


def windows(clocks, *cores) -> list[int]:
    """One full window per entry at that many cores, checked; the thread count after each."""
    seen = []
    for c in cores:
        clocks.advance(W, c)
        threads.check()
        seen.append(torch.get_num_threads())
    return seen


def test_fewer_threads_for_the_rest_of_the_call_and_the_next_calls(clocks):
    with threads.adaptive(CPU):
        clocks.advance(W / 2, 2.4)
        threads.check()  # a window too short decides nothing
        assert torch.get_num_threads() == 4
        # two short windows in a row: 2.4 cores for 4 threads, down to 2 for the rest of
        # the call
        assert windows(clocks, 2.4, 2.4, 2.0) == [4, 2, 2]
    assert torch.get_num_threads() == 4  # put back when the call ends
    with threads.adaptive(CPU):  # within the hold: starts lowered, measures nothing
        assert torch.get_num_threads() == 2
        assert windows(clocks, 3.9, 3.9, 3.9) == [2, 2, 2]
    assert torch.get_num_threads() == 4
    clocks.advance(threads.HOLD_S, 0.0)
    with threads.adaptive(CPU):  # the hold is over: full count, measured again
        assert torch.get_num_threads() == 4
        assert windows(clocks, 1.0, 1.0) == [4, 1]  # never below 1
    assert torch.get_num_threads() == 4


def test_a_quiet_process_keeps_its_threads(clocks):
    with threads.adaptive(CPU):
        # within SLACK of 4; a single short window between quiet ones decides nothing
        assert windows(clocks, 0.5, 4.0, 3.7, 3.0, 3.9, 3.0, 4.0) == [4] * 7
        assert windows(clocks, 3.0, 3.0) == [4, 3]


def test_the_first_call_of_a_process_is_not_measured(clocks, monkeypatch):
    """Libraries initialise during the first call, on one thread: it would look like
    contention."""
    monkeypatch.setattr(threads, "warm", {"done": False})
    with threads.adaptive(CPU):
        assert windows(clocks, 0.5, 0.5, 0.5, 0.5) == [4] * 4
    assert threads.warm["done"]
    with threads.adaptive(CPU):
        assert windows(clocks, 0.5, 0.5) == [4, 1]


@pytest.mark.parametrize("case", ["disabled", "not cpu", "nested", "one thread", "outside"])
def test_no_change_where_it_does_not_apply(clocks, monkeypatch, case):
    if case == "disabled":
        monkeypatch.setattr(threads, "ENABLED", False)
    if case == "one thread":
        torch.set_num_threads(1)
    n = torch.get_num_threads()
    device = torch.device("meta") if case == "not cpu" else CPU
    with threads.adaptive(CPU) if case == "nested" else torch.no_grad():
        with threads.adaptive(device) if case != "outside" else torch.no_grad():
            seen = windows(clocks, 0.5, 0.5)
            if case == "nested":  # the outer context measures: it lowers
                assert seen == [n, 1]
                return
            assert seen == [n] * 2
    assert threads.hold_until["until"] == float("-inf")


def test_a_call_that_lowers_its_threads_gives_the_same_results(clocks, monkeypatch):
    """The torch path's blocked loops check at each block: a call whose clocks say one core
    falls short lowers the count mid-call, and its outputs and gradients are the full count's."""
    from rfattn import blocked

    monkeypatch.setattr(blocked, "BLOCK_ELEMENTS", 2 * 32 * 128)  # blocks of 128 tokens
    torch.set_num_threads(2)
    rf = rfattn.RandomFeatures(8, 32, seed=0).double()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 600, 8, generator=g, dtype=torch.float64) for _ in range(3))
    cot = torch.randn(1, 2, 600, 8, generator=g, dtype=torch.float64)

    def run(causal):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = rfattn.rf_attention(*leaves, rf, causal=causal, backend="torch")
        return [out.detach(), *torch.autograd.grad(out, leaves, cot)]

    real_check = threads.check

    def busy_check():
        clocks.advance(W, 1.2)  # each block: 1.2 cores for 2 threads
        real_check()

    for causal in (True, False):
        threads.ENABLED = False
        want = run(causal)
        threads.ENABLED = True
        threads.hold_until["until"] = float("-inf")
        monkeypatch.setattr(threads, "check", busy_check)
        got = run(causal)
        monkeypatch.setattr(threads, "check", real_check)
        assert threads.hold_until["threads"] == 1 and torch.get_num_threads() == 2
        for a, b in zip(got, want, strict=True):
            assert rel_rms(a, b) <= tolerance(torch.float64, "grad")


@pytest.mark.slow  # ~8 s
def test_adaptation_is_opt_in():
    """A library call leaves torch's process-wide thread count alone unless asked: the
    adaptation is off by default and on with RFATTN_ADAPTIVE_THREADS=1 (issue 35)."""
    import os
    import subprocess
    import sys

    code = "import rfattn.threads as t; print(t.ENABLED)"
    env = {k: v for k, v in os.environ.items() if k != "RFATTN_ADAPTIVE_THREADS"}
    run = [sys.executable, "-c", code]
    assert subprocess.run(run, env=env, capture_output=True, text=True).stdout.strip() == "False"
    env["RFATTN_ADAPTIVE_THREADS"] = "1"
    assert subprocess.run(run, env=env, capture_output=True, text=True).stdout.strip() == "True"


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts Linux's threads")
def test_worker_threads_start_no_thread_team_of_their_own():
    """The pool of head workers, its workers running parallel ops, starts the workers and no
    other thread: no OpenMP team of a worker's own, whose idle threads stalled every parallel
    region of the caller's thread while the pool lived (small products 5-8x slower after any
    call split over the heads, a decoding step after a long prompt 2x; before: team threads
    for every worker). Counted as the process's OS threads against its Python threads, around
    a pool made anew (a thread count the pool was not made for)."""
    import threading

    def counts():
        return len(os.listdir("/proc/self/task")), threading.active_count()

    full = torch.get_num_threads()
    n = max(full, threads.worker_pool["workers"]) + 1  # a count no pool of this process has
    try:
        torch.set_num_threads(n)  # (which starts threads of its own: before counting)
        torch.ones(1 << 16).sum()  # the caller's own team exists before counting
        before = counts()
        threads.over_heads(lambda h0, h1: torch.ones(1 << 20).exp().sum(),  # a parallel op
                           [(h, h + 1) for h in range(n)])  # fmt: skip
        after = counts()
        assert threads.worker_pool["workers"] == n  # a new pool (its workers: Python threads)
    finally:
        torch.set_num_threads(full)
    assert after[0] - before[0] == after[1] - before[1]
