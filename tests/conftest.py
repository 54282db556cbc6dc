"""Shared test setup: compile's plan cache (planners/cache.py) never writes into the home folder.
TURNIP_PLAN_CACHE_DIR points under pytest's tmp folder (made on the first store): one folder for
the session, which module- and session-scoped fixtures compile in, and one of its own for every
test, so no test reads a plan another test stored."""

from __future__ import annotations

import hashlib

import pytest

VARIABLE = "TURNIP_PLAN_CACHE_DIR"


@pytest.fixture(scope="session", autouse=True)
def _session_plan_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:  # set up before any module-scoped fixture compiles
        patch.setenv(VARIABLE, str(tmp_path_factory.getbasetemp() / "turnip-plans" / "session"))
        yield


@pytest.fixture(autouse=True)
def _own_plan_cache(request, tmp_path_factory, monkeypatch):
    name = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:16]
    monkeypatch.setenv(VARIABLE, str(tmp_path_factory.getbasetemp() / "turnip-plans" / name))
