"""No credential at rest (issue 28, item 1): a password, token or presigned signature in a
storage URI is refused before anything is written or sent, by every writer of a TrainJob (the
CLI's local and cluster runs, ``render trainjob``, both backends of ``TrainingClient``), with one
line naming the part (never its value) and the Secret-based way. The Secret-based way itself
(``HTTPS_USERNAME``/``HTTPS_PASSWORD`` in the environment) trains, and no file the run writes
holds the password."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

import pytest

from tunepack import FineTune, Initializer, LocalBackendConfig, TrainingClient
from tunepack.core.errors import UnsupportedError

PASSWORD = "pw-s3cr3t-7f1e"
SIGNATURE = "sig-0a9b8c7d6e5f"
CLI = [sys.executable, "-m", "tunepack.cli"]


def _files_holding(secret: str, *roots: Path) -> list[str]:
    """Every file under ``roots`` whose bytes contain ``secret``."""
    found = []
    for root in roots:
        for path in Path(root).rglob("*"):
            if path.is_file() and not path.is_symlink() and secret.encode() in path.read_bytes():
                found.append(str(path))
    return found


def _cli(tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "TUNEPACK_HOME": str(tmp_path / "home"), **(env or {})},
        timeout=600,
    )


URIS = [
    pytest.param(
        f"https://bob:{PASSWORD}@127.0.0.1:9/d.jsonl",
        PASSWORD,
        "dataset storage URI 'https://***@127.0.0.1:9/d.jsonl' carries a user name or password "
        "(user:password@): tunepack never writes a credential into a TrainJob or a job record; "
        "give the URI without it and the credential in the environment (HTTPS_USERNAME and "
        "HTTPS_PASSWORD for https://",
        id="userinfo",
    ),
    pytest.param(
        f"https://host.example/d.jsonl?X-Amz-Expires=60&X-Amz-Signature={SIGNATURE}",
        SIGNATURE,
        "dataset storage URI 'https://host.example/d.jsonl?X-Amz-Expires=***&X-Amz-Signature=***' "
        "carries query parameter 'X-Amz-Expires' (a presigned URL's signature or a token, "
        "maybe): tunepack never writes a credential",
        id="presigned",
    ),
]


@pytest.mark.parametrize(("dataset", "secret", "message"), URIS)
def test_a_credential_in_a_uri_is_refused_by_every_writer_and_stored_nowhere(
    tmp_path, tiny_model_dir, dataset, secret, message
):
    model = f"file://{tiny_model_dir}"
    job = ["--runtime", "tiny-llama3", "--dataset", dataset, "--model", model, "max_steps=1"]
    for argv in (
        ["train", "--local", "--workspace", str(tmp_path / "ws"), *job],
        ["render", "trainjob", *job],
    ):
        done = _cli(tmp_path, *argv)
        assert done.returncode == 65, (argv, done.stderr)
        assert done.stdout == ""
        assert done.stderr.startswith(f"tunepack: error: {message}"), done.stderr
        assert done.stderr.count("\n") == 1  # one line
        assert "Secret (--dataset-secret, Initializer(dataset_secret=))" in done.stderr
        assert secret not in done.stderr

    client = TrainingClient(LocalBackendConfig(root_dir=str(tmp_path / "sdk-jobs")))
    with pytest.raises(UnsupportedError) as refused:
        client.train(
            runtime="tunepack-tiny-llama3",
            initializer=Initializer(dataset=dataset, model=model),
            trainer=FineTune(max_steps=1),
        )
    assert str(refused.value).startswith(message) and secret not in str(refused.value)
    assert _files_holding(secret, tmp_path) == []
    assert not (tmp_path / "home" / "jobs").exists() and not (tmp_path / "sdk-jobs").exists()


def test_a_cluster_trainjob_with_a_credential_in_a_uri_is_never_sent(tmp_path):
    """The Kubernetes backend builds the TrainJob with the same check before any request."""
    from tunepack.jobs.submit import build

    with pytest.raises(UnsupportedError) as refused:
        build(
            "tunepack-tiny-llama3",
            Initializer(dataset="hf://org/data", model=f"https://u:{PASSWORD}@models.example/m"),
            FineTune(),
            memory_check="off",
        )
    assert str(refused.value).startswith(
        "model storage URI 'https://***@models.example/m' carries a user name or password"
    )
    assert PASSWORD not in str(refused.value)


class _BasicAuthFiles(SimpleHTTPRequestHandler):
    """Serves files to user bob with PASSWORD only (401 otherwise)."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        expected = "Basic " + base64.b64encode(f"bob:{PASSWORD}".encode()).decode()
        if self.headers.get("Authorization") != expected:
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="data"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        super().do_GET()


@pytest.fixture
def auth_server(tmp_path, tiny_dataset_file):
    root = tmp_path / "served"
    root.mkdir()
    (root / "d.jsonl").write_bytes(tiny_dataset_file.read_bytes())
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_BasicAuthFiles, directory=str(root)))
    Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_secret_based_way_trains_and_no_file_of_the_run_holds_the_password(
    tmp_path, tiny_model_dir, auth_server
):
    """HTTPS_USERNAME/HTTPS_PASSWORD in the environment (on a cluster: a Secret): the dataset
    is fetched, the run completes, and neither the console nor any file under the jobs
    directory and the workspace (records, logs, manifests, config, result) holds the password."""
    workspace = tmp_path / "ws"
    argv = [
        "train", "--local", "--runtime", "tiny-llama3", "--workspace", str(workspace),
        "--dataset", f"{auth_server}/d.jsonl", "--model", f"file://{tiny_model_dir}",
        "max_steps=1",
    ]  # fmt: skip
    without = _cli(tmp_path, *argv)
    assert without.returncode == 65, without.stderr
    assert f"'{auth_server}/d.jsonl' answered 401 (Unauthorized): access denied; check " in (
        without.stdout + without.stderr
    )
    done = _cli(tmp_path, *argv, env={"HTTPS_USERNAME": "bob", "HTTPS_PASSWORD": PASSWORD})
    assert done.returncode == 0, done.stdout + done.stderr
    assert PASSWORD not in done.stdout + done.stderr
    assert (workspace / "output" / "result.json").exists()
    assert list((tmp_path / "home" / "jobs").iterdir())  # the job's record was written...
    assert _files_holding(PASSWORD, tmp_path / "home", workspace) == []  # ...without it
