"""A test helper: the peak of the CPU allocator's live bytes while a function runs.

torch.profiler's memory events (profile_memory=True) record every allocation and free through
torch's allocator, in order; the highest running sum of them above the level at the start is what
torch.cuda.max_memory_allocated counts on a GPU. prof.events() leaves out the events inside ops,
so they are read from the exported trace.
"""

import json
import os
import tempfile

from torch.profiler import ProfilerActivity, profile


def allocator_peak(fn) -> int:
    """Bytes: the highest running sum of allocations minus frees while fn() runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            events = json.load(f)["traceEvents"]
    running = peak = 0
    for _, nbytes in sorted((e["ts"], e["args"]["Bytes"]) for e in events
                            if e.get("name") == "[memory]"):
        running += nbytes
        peak = max(peak, running)
    return peak
