"""What makes a test a unit test, enforced: it starts no process and listens on no socket. A
test that needs either belongs in tests/integration."""

from __future__ import annotations

import multiprocessing.process
import os
import socket
import subprocess

import pytest


def _refuse(what: str):
    def refused(*args, **kwargs):
        raise AssertionError(
            f"a unit test {what}: move it to tests/integration (tests/__init__.py says which "
            "tier holds what)"
        )

    return refused


@pytest.fixture(autouse=True)
def _pure(monkeypatch):
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("started a process"))
    monkeypatch.setattr(os, "fork", _refuse("forked a process"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse("started a process"))
    monkeypatch.setattr(socket.socket, "listen", _refuse("listened on a socket"))
