"""tunepack's tests, by what they need: tests/unit (pure Python), tests/integration (real
processes and loopback servers), tests/cluster (the real control plane: make test-cluster, with
its machinery in tests/controlplane). Shared helpers live here: helpers.py, fakehub.py,
fake_apiserver.py."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the repository root
