"""Training progress for the Kubeflow Trainer controller (``TrainJob.status.trainerStatus``;
docs/trainer.md, "Progress").

The protocol is that of the Kubeflow SDK's ``kubeflow.trainer.update_trainjob_status``, but that
helper posts synchronously from the caller and silently drops calls within 5 s of the last,
which would stall a training step on a slow server and could drop the final 100% update. So this
reporter posts from a background thread: the loop only hands over its newest snapshot, the
thread posts at most every ``interval`` seconds, and the last snapshot is always sent on close.
A down server costs a log line, never the run.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import UTC, datetime

log = logging.getLogger("tunepack.trainer")

URL_ENV = "KUBEFLOW_TRAINER_SERVER_URL"
CA_CERT_ENV = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
TOKEN_ENV = "KUBEFLOW_TRAINER_SERVER_TOKEN"
MIN_INTERVAL_S = 5.0  # the SDK helper's rate limit: the controller expects no more
REQUEST_TIMEOUT_S = 5.0


def status_payload(
    progress_percent: int, remaining_s: int | None, metrics: dict[str, object]
) -> dict:
    status: dict = {
        "progressPercentage": max(0, min(100, int(progress_percent))),
        "metrics": [{"name": str(k), "value": str(v)} for k, v in metrics.items()],
        "lastUpdatedTime": datetime.now(UTC).isoformat(),
    }
    if remaining_s is not None:
        status["estimatedRemainingSeconds"] = max(0, int(remaining_s))
    return {"trainerStatus": status}


class StatusReporter:
    """Posts the newest progress snapshot from a background thread, rate-limited."""

    # What the rate limit reads; a test sets a fake clock to check the rule, not the speed.
    clock = staticmethod(time.monotonic)

    def __init__(
        self,
        url: str,
        ca_file: str | None,
        token_path: str | None,
        interval: float = MIN_INTERVAL_S,
    ) -> None:
        import requests  # only runs that report pay for the import

        self.url, self.ca_file, self.token_path = url, ca_file, token_path
        self.interval = interval
        self._session = requests.Session()
        self._snapshot: dict | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._failures = 0
        self._thread = threading.Thread(target=self._run, name="trainer-status", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls) -> StatusReporter | None:
        url = os.environ.get(URL_ENV)
        if not url:
            return None
        return cls(url, os.environ.get(CA_CERT_ENV), os.environ.get(TOKEN_ENV))

    def update(self, progress_percent: int, remaining_s: int | None, metrics: dict) -> None:
        """Hand over the newest snapshot; returns at once."""
        with self._lock:
            self._snapshot = status_payload(progress_percent, remaining_s, metrics)
        self._wake.set()

    def close(self, timeout: float = REQUEST_TIMEOUT_S + 1) -> None:
        """Send the last snapshot (if not sent yet) and stop the thread."""
        self._closing = True
        self._wake.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        last_post = float("-inf")
        while True:
            self._wake.wait()
            wait = last_post + self.interval - self.clock()
            if wait > 0 and not self._closing:
                time.sleep(min(wait, 0.5))  # short naps keep close() prompt
                continue
            self._wake.clear()
            with self._lock:
                payload, self._snapshot = self._snapshot, None
            if payload is not None:
                self._post(payload)
                last_post = self.clock()
            if self._closing:
                return

    def _post(self, payload: dict) -> None:
        try:
            headers = {"Content-Type": "application/json"}
            token = self._token()
            if token:
                headers["Authorization"] = f"Bearer {token}"
            verify: bool | str = self.ca_file if self.ca_file else True
            response = self._session.post(
                self.url, json=payload, headers=headers, verify=verify, timeout=REQUEST_TIMEOUT_S
            )
            if response.status_code >= 300:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
            self._failures = 0
        except Exception as err:  # progress is best effort: never fail training over it
            self._failures += 1
            if self._failures == 1 or self._failures % 20 == 0:
                log.warning(
                    "progress update to %s failed (%d in a row): %s", self.url, self._failures, err
                )

    def _token(self) -> str | None:
        # Re-read on every post: the projected token is rotated by the kubelet.
        if not self.token_path:
            return None
        try:
            with open(self.token_path) as f:
                return f.read().strip() or None
        except OSError as err:
            log.warning("cannot read the progress token at %s: %s", self.token_path, err)
            return None
