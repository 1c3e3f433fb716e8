"""Opt-in: the SDK flow against a cluster of your own with Kubeflow Trainer (``pytest -m cluster
tests/cluster/test_own_cluster.py``), not the tier's control plane (``make test-cluster`` selects
``-m controlplane``, the default run deselects both).

Skipped unless KUBECONFIG points at a cluster; see docs/cluster.md for a kind recipe.
"""

from __future__ import annotations

import os

import pytest

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(
        not os.environ.get("KUBECONFIG") or not os.path.exists(os.environ["KUBECONFIG"]),
        reason="needs KUBECONFIG pointing at a cluster with Kubeflow Trainer v2.3",
    ),
]


def test_install_train_wait_logs_delete_on_a_real_cluster():
    from kubernetes import client, config

    from tunepack import FineTune, Initializer, TrainingClient
    from tunepack.tools.install import apply, runtime_objects

    config.load_kube_config()
    api = client.ApiClient()
    for obj in runtime_objects(["tiny-llama3"]):
        apply(api, obj)
    tc = TrainingClient()
    assert "tunepack-tiny-llama3" in [r.name for r in tc.list_runtimes()]
    name = tc.train(
        runtime="tunepack-tiny-llama3",
        initializer=Initializer(
            dataset=os.environ.get("TUNEPACK_CLUSTER_DATASET", "file:///data/tiny.jsonl"),
            model=os.environ.get("TUNEPACK_CLUSTER_MODEL", "file:///models/tiny-llama3"),
        ),
        trainer=FineTune(epochs=1, max_steps=4),
    )
    try:
        job = tc.wait_for_job_status(name, timeout=900)
        assert job.status == "Complete"
        assert any(line for line in tc.get_job_logs(name))
    finally:
        tc.delete_job(name)
