"""Test configuration: kernels run under the Triton interpreter when CUDA is absent.

TRITON_INTERPRET must be set before ``rfattn.kernels`` is first imported (kernels are decorated
at import), so this happens here, before any test module imports rfattn.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one thread per xdist worker (make test runs one worker per core): the interpreter's numpy
    # and torch's thread pool would otherwise oversubscribe the cores
    torch.set_num_threads(1)

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture
def kernel_device():
    """Where the Triton kernels run: CUDA when present, else CPU under the interpreter."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(autouse=True)
def _fixed_threads(monkeypatch):
    """Tests run on torch's configured thread count: rfattn.threads would lower it when the test
    workers compete for the cores, and a reduction's rounding depends on it (tests that compare
    two calls bitwise). tests/test_threads.py turns it on where it is the subject."""
    from rfattn import threads

    monkeypatch.setattr(threads, "ENABLED", False)
