"""A pytest plugin: each test gets at most --deadline seconds, then fails by name.

A test that hangs (a CUDA kernel that never returns to Python is the exception: it waits for the
kernel) raises TimeoutError from a SIGALRM and is reported like any failure, so a run with a
wall-clock limit still names what went wrong instead of ending silently. POSIX only.

    python -m pytest -p deadline --deadline 120 tests      # with tests/ on PYTHONPATH
"""

import signal

import pytest


def pytest_addoption(parser):
    parser.addoption("--deadline", type=float, default=0.0,
                     help="seconds a test may run before it fails (0: no limit)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    seconds = item.config.getoption("deadline")
    if not seconds or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"{item.nodeid} ran past --deadline {seconds:g} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
