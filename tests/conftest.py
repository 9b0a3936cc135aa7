"""Shared test configuration.

Under CI (the CI variable is set) hypothesis runs a fixed, derandomized set of examples, so a
submission's result does not depend on the draw; locally it explores new examples every run.
"""

import os

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_collection_modifyitems(config, items):
    """``gpu``-marked tests skip, with the reason, where CUDA is absent."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is false); run `make gpu-check` on a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_native_manager_left_attached():
    """A test that ends with a MemoryManager still attached on the native source (one per process)
    would make every later test's manager fall back or fail: stop its observer and fail that test."""
    yield
    import sys

    events = sys.modules.get("dynn_runtime.runtime.events")
    if events is None or not events.QUIET:
        return
    for obs in list(events.QUIET):
        obs.stop()
        events.QUIET.remove(obs)
    pytest.fail("the test left a MemoryManager attached on the native event source; detach() it (a finally: block)")
