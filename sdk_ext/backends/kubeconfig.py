"""Which Kubernetes configuration there is (the kubeconfig, as kubectl chooses it, else the
in-cluster config), and the one line that says what is wrong with it when the Kubernetes client
cannot load it: for ``TrainingClient()`` (the Kubernetes backend) and the CLI's cluster commands
(``tunepack.cli.cluster``). Standard library only at import; the kubernetes client is imported
where it is asked."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_KUBECONFIG = "~/.kube/config"


def kubeconfig_paths() -> tuple[str, list[str]]:
    """Which kubeconfig files exist of those kubectl would read, and, for a message when none
    does, what was looked for."""
    env = os.environ.get("KUBECONFIG")
    if env:
        paths = [p for p in env.split(os.pathsep) if p]
        missing = (
            f"$KUBECONFIG={env} does not exist"
            if len(paths) == 1
            else f"none of the files in $KUBECONFIG={env} exists"
        )
    else:
        paths = [str(Path(DEFAULT_KUBECONFIG).expanduser())]
        missing = f"{DEFAULT_KUBECONFIG} ({paths[0]}) does not exist, KUBECONFIG is not set"
    return missing, [p for p in paths if Path(p).expanduser().is_file()]


def no_configuration_message(alternative: str, missing: str | None = None) -> str:
    """The one line for no Kubernetes configuration at all; ``alternative`` ends it (how to
    use the local backend instead)."""
    missing = missing or kubeconfig_paths()[0]
    return (
        f"no Kubernetes configuration: {missing}, and this is not a Pod in a cluster; set "
        f"KUBECONFIG to your cluster's kubeconfig{alternative}"
    )


def configuration_problem(err: Exception, alternative: str) -> str:
    """The one line for the Kubernetes client's own configuration error ``err``."""
    missing, existing = kubeconfig_paths()
    if not existing and not in_cluster():
        return no_configuration_message(alternative, missing)
    where = os.pathsep.join(existing) if existing else "the Pod's service account"
    reason = str(err).rstrip(".")
    return (
        f"invalid Kubernetes configuration in {where}: {reason}; fix it, or choose a context "
        f"that exists{alternative}"
    )


def in_cluster() -> bool:
    """Whether this is a Pod with a service account the in-cluster config can load."""
    from kubernetes.config.incluster_config import SERVICE_HOST_ENV_NAME, SERVICE_TOKEN_FILENAME

    return bool(os.environ.get(SERVICE_HOST_ENV_NAME)) and Path(SERVICE_TOKEN_FILENAME).is_file()
