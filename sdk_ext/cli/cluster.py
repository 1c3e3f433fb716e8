"""The CLI's cluster: which configuration a command uses (the kubeconfig, as kubectl chooses it,
else the in-cluster config: found by ``tunepack.backends.kubeconfig``, which the SDK's
``TrainingClient()`` shares), and the check that it is there and its API server answers, before
any cluster command talks to it: one line that says what is wrong and what to do, never a
traceback.

Exit codes (``tunepack.core.errors``): no or broken Kubernetes configuration is a configuration
error, 65 (fix it, retrying cannot help); an API server that cannot be reached is transient, 75.
"""

from __future__ import annotations

import argparse
import os
import socket
from urllib.parse import urlsplit

import yaml

from tunepack.backends.kubeconfig import in_cluster, kubeconfig_paths, no_configuration_message
from tunepack.core.errors import BadValueError, TransientError

PROBE_TIMEOUT_S = 5.0

# The API server the last check found: named when a later request cannot reach it.
last_server: str | None = None


def backend_config(ns: argparse.Namespace):
    """The SDK's backend config for a command's ``--namespace`` and ``--context``, choosing the
    cluster as kubectl does: the kubeconfig (``$KUBECONFIG`` or ``~/.kube/config``) when there is
    one, else the in-cluster config.

    (The SDK alone takes the in-cluster config whenever ``/var/run/secrets/kubernetes.io``
    exists, even where a kubeconfig was meant.)
    """
    from kubeflow.common.types import KubernetesBackendConfig
    from kubernetes import config

    namespace, context = getattr(ns, "namespace", None), getattr(ns, "context", None)
    _, existing = kubeconfig_paths()
    if not existing:
        return KubernetesBackendConfig(namespace=namespace, context=context)
    kubeconfig = os.pathsep.join(existing)
    if namespace is None:
        contexts, current = config.list_kube_config_contexts(config_file=kubeconfig)
        chosen = next((c for c in contexts if c.get("name") == context), None) if context else None
        namespace = ((chosen or current or {}).get("context") or {}).get("namespace") or "default"
    return KubernetesBackendConfig(namespace=namespace, context=context, config_file=kubeconfig)


def load_config(context: str | None = None) -> None:
    """Load the same choice as the kubernetes client's default configuration, for a command that
    calls the API itself (``tunepack install``)."""
    from kubernetes import config

    _, existing = kubeconfig_paths()
    if existing:
        config.load_kube_config(config_file=os.pathsep.join(existing), context=context)
    else:
        config.load_incluster_config()


def check_cluster(context: str | None = None, *, local_option: bool = True) -> str:
    """Raise a one-line error unless a cluster is configured and its API server accepts a
    connection; return the server's URL."""
    global last_server
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    missing, existing = kubeconfig_paths()
    alternative = ", or add --local to use the local backend" if local_option else ""
    configuration = client.Configuration()
    if existing:
        source = os.pathsep.join(existing)
        try:
            config.load_kube_config(
                config_file=source, context=context, client_configuration=configuration
            )
        except ConfigException as err:
            reason = str(err).rstrip(".")
            raise BadValueError(
                f"invalid Kubernetes configuration in {source}: {reason}; fix the file, or "
                f"choose a context that exists with --context{alternative}"
            ) from None
        except (OSError, ValueError, AttributeError, TypeError, yaml.YAMLError) as err:
            # Unreadable, not YAML, or YAML that is not a kubeconfig mapping.
            raise BadValueError(
                f"cannot read the Kubernetes configuration {source}: {_yaml_reason(err)}; fix the "
                f"file or point KUBECONFIG at a valid kubeconfig{alternative}"
            ) from None
    elif in_cluster():
        try:
            config.load_incluster_config(client_configuration=configuration)
        except ConfigException as err:
            raise BadValueError(f"invalid in-cluster Kubernetes configuration: {err}") from None
    else:
        raise BadValueError(no_configuration_message(alternative))
    server = configuration.host
    last_server = server
    if not configuration.proxy:
        probe(server)
    return server


def probe(server: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Raise TransientError naming ``server`` when no TCP connection to it can be opened."""
    parts = urlsplit(server)
    host = parts.hostname or server
    port = parts.port or (80 if parts.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return
    except OSError as err:
        reason = _reason(err)
    raise TransientError(
        f"cannot reach the Kubernetes API server {server} ({reason}); check that the cluster is "
        "running and that your kubeconfig (or --context) points at it, then run the command again"
    )


def _yaml_reason(err: BaseException) -> str:
    if isinstance(err, yaml.MarkedYAMLError):
        mark = err.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        return f"not valid YAML{where}: {err.problem}"
    if isinstance(err, yaml.YAMLError):
        return f"not valid YAML: {err}"
    if isinstance(err, OSError):
        return (err.strerror or str(err)).lower()
    return f"not a kubeconfig ({type(err).__name__}: {err})"


def _reason(err: BaseException) -> str:
    if isinstance(err, TimeoutError | socket.timeout):
        return "no answer: timed out"
    if isinstance(err, socket.gaierror):
        return f"unknown host: {err.strerror or err}"
    return (getattr(err, "strerror", None) or str(err)).lower()


def is_connection_error(err: BaseException | None) -> bool:
    """Whether ``err`` (or what caused it) is a failure to reach the API server at all."""
    from urllib3.exceptions import MaxRetryError, NewConnectionError, ProtocolError, TimeoutError

    while err is not None:
        if isinstance(err, MaxRetryError | NewConnectionError | ProtocolError | TimeoutError):
            return True
        if isinstance(err, ConnectionError | socket.timeout):
            return True
        err = err.__cause__ or err.__context__
    return False
