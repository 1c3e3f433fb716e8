"""What an error from the Kubernetes API says: its HTTP status and the ``Status`` body's
message, found on the error or on the one it was raised from (the Kubeflow SDK wraps the
client's ``ApiException`` in ``RuntimeError``). Reads attributes only: importing it loads no
Kubernetes client, so the CLI can use it to word any error in one line.
"""

from __future__ import annotations


def api_status(err: BaseException | None) -> int | None:
    """The HTTP status of the Kubernetes API error ``err`` is or was caused by, if any."""
    while err is not None:
        status = getattr(err, "status", None)
        if isinstance(status, int):
            return status
        err = err.__cause__
    return None


def api_message(err: BaseException | None) -> str | None:
    """The ``message`` of the Kubernetes ``Status`` body that ``err`` (or its cause) carries."""
    import json

    while err is not None:
        body = getattr(err, "body", None)
        if body:
            try:
                return json.loads(body).get("message")
            except (ValueError, AttributeError):
                return None
        err = err.__cause__
    return None
