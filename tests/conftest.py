"""Session-wide test setup."""

import os

import pytest
import torch

# Triton kernels run on CPU tensors through Triton's interpreter. It must be chosen
# before triton is first imported, so it is set here, for the whole session.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`make test` runs one worker per core) each worker, and each server
# process it starts, computes on one thread: two workers of two threads on two cores
# would fight over them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def engine_integrity_after_each_test(request):
    """Every test that uses a module's ``engine`` fixture (a radixkv Engine) leaves its
    pool and tree consistent."""
    engine = request.getfixturevalue("engine") if "engine" in request.fixturenames else None
    yield
    if engine is not None:
        engine.check_integrity()
