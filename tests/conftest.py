"""The suite's one pytest hook: with REFERENCES_REQUIRED=1 a comparison with the references cannot
skip unseen.

transformers, trl and peft are not requirements of the engine, so a test that compares with them
skips where they are not installed (pytest.importorskip), and so does one that reads published
files the repository does not carry (the Qwen3 and Llama 3.1 tokenizers, SmolLM2: their skips name
the variable that points at them). CI's step with the references installed (.ci/run) sets
REFERENCES_REQUIRED=1: there such a skip is a failure, whichever test raised it (a new one too).
Other skips (a CUDA-only file on a CPU, a kernel this torch lacks) compare with nothing and stay.
"""

import os
import re

import pytest

REQUIRED = os.environ.get("REFERENCES_REQUIRED") == "1"
# importorskip's reason for a reference (any of its submodules), or a published file's variable
COMPARISON = re.compile(r"could not import '(transformers|trl|peft)[.']"
                        r"|QWEN3_TOKENIZER_DIR|LLAMA31_TOKENIZER_DIR|SMOLLM2_DIR")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (REQUIRED and report.skipped and call.excinfo is not None):
        return
    reason = str(call.excinfo.value)
    if COMPARISON.search(reason):
        report.outcome = "failed"
        report.longrepr = (f"skipped a comparison with the references under "
                           f"REFERENCES_REQUIRED=1: {reason}")
