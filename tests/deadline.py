"""A pytest plugin: each test gets at most --deadline seconds, then fails by name; and a failure's
last lines are printed as it happens, not only in the summary at the end.

A test that hangs (a CUDA kernel that never returns to Python is the exception: it waits for the
kernel) raises TimeoutError from a SIGALRM and is reported like any failure, so a run with a
wall-clock limit still names what went wrong, and why, instead of ending silently. POSIX only.

    python -m pytest -p deadline --deadline 120 tests      # with tests/ on PYTHONPATH
"""

import signal

import pytest


def pytest_addoption(parser):
    parser.addoption("--deadline", type=float, default=0.0,
                     help="seconds a test may run before it fails (0: no limit)")


_SAY_AT_ONCE = []  # set when --deadline is given: failures are said as they happen


def pytest_configure(config):
    if config.getoption("deadline"):
        _SAY_AT_ONCE.append(True)


def pytest_runtest_logreport(report):
    """A failure's reason at once (under xdist this runs in the controller as reports arrive)."""
    if report.failed and _SAY_AT_ONCE:
        lines = [line for line in report.longreprtext.splitlines() if line.strip()][-6:]
        print(f"\nFAILED {report.nodeid} ({report.when}):\n  " + "\n  ".join(lines), flush=True)


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
