"""Plan tests share one trace cache for the session, in a temporary folder (never the user's, never the repo)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def trace_cache_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("paratrain-cache")
    saved = os.environ.get("PARATRAIN_CACHE")
    os.environ["PARATRAIN_CACHE"] = str(path)  # subprocesses (the `cli` fixture) inherit it
    yield path
    if saved is None:
        os.environ.pop("PARATRAIN_CACHE", None)
    else:
        os.environ["PARATRAIN_CACHE"] = saved
