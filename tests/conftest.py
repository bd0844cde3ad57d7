import os
import tempfile

import pytest
import torch

# Kernels written by the tests go to a throwaway cache unless the caller chose one.
os.environ.setdefault("FUSER_CACHE_DIR", tempfile.mkdtemp(prefix="fuser-test-cache-"))


@pytest.fixture
def device() -> torch.device:
    """CUDA when there is a GPU; otherwise CPU tensors through Triton's interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
