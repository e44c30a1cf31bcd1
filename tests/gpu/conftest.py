"""The data plane on CUDA tensors (`make gpu-check` runs this folder on a GPU machine).

Each test takes `device`: "cpu" always runs (the CPU-side parts, in `make test`),
"cuda" only where torch sees a CUDA device, and is skipped with the reason elsewhere.
Tests that only mean something on a GPU (copy streams racing kernels) take `cuda`.
"""

from __future__ import annotations

import pytest
import torch

NO_CUDA = "no CUDA device: torch.cuda.is_available() is False (run `make gpu-check` on a GPU)"


@pytest.fixture(params=["cpu", "cuda"])
def device(request: pytest.FixtureRequest) -> torch.device:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    return torch.device(request.param)


@pytest.fixture
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    return torch.device("cuda")
