"""The exporter (``python -m tunepack.initializers.export``) and fetching an export back.

A real tiny LoRA run's output is exported to a directory, to moto's S3 server (with IAM
credentials enforced) and to tests/fakehub.py (uploads and commits), as subprocesses, as the
local backend and a Pod run it: verified uploads, the manifest last, re-runs that finish a killed
upload without sending anything twice, wrong credentials refused in one line (exit 65) with
nothing visible, and ``fetch_export`` downloading what was exported.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.fakehub import FakeHub
from tunepack.core.errors import (
    EXIT_BAD_INPUT,
    BadValueError,
    ConflictError,
    NotFoundError,
)
from tunepack.core.workspace import MANIFEST_FILE
from tunepack.initializers.sinks import fetch_export
from tunepack.runtimes.contract import containers, replicated_jobs

TOKEN = "hf_write_secret_0123456789"
READ_TOKEN = "hf_read_only_secret_987654"
SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
# lora_rank=768 makes the adapter larger than 5 MiB: several parts of 5 MiB, so S3's multipart
# path runs.
RANK = 768
EXPORTED = [
    "adapter/adapter_config.json",
    "adapter/adapter_model.safetensors",
    "config.yaml",
    "metrics.jsonl",
    "result.json",
]


# --- a finished run ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir, tiny_dataset_file) -> Path:
    """The workspace of a real tiny LoRA run (read-only for the tests)."""
    ws = tmp_path_factory.mktemp("trained") / "ws"
    done = _cli(
        *_train_local(tiny_model_dir, tiny_dataset_file, ws, "export-src"),
        f"lora_rank={RANK}",
        "max_steps=6",
        env={},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((ws / "output" / "result.json").read_text())
    assert result["final_loss"] < result["first_loss"]
    assert (ws / "output" / "adapter" / "adapter_model.safetensors").stat().st_size > 5 << 20
    return ws


def run_export(trained: Path, tmp_path: Path, uri: str, env=None, wait=True):
    drop = {"EXPORT_URI", "HF_TOKEN", "ACCESS_TOKEN", "HF_ENDPOINT"}
    base = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("AWS_")}
    base.update(
        TUNEPACK_WORKSPACE=str(trained),
        EXPORT_URI=uri,
        HF_HOME=str(tmp_path / "hf-home"),
        HF_HUB_DISABLE_XET="1",  # the fake hub speaks LFS, not Xet
        TUNEPACK_RETRY_BACKOFF_SECONDS="0.01",
        AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE=str(tmp_path / "no-aws-config"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-aws-credentials"),
        **(env or {}),
    )
    command = [sys.executable, "-m", "tunepack.initializers.export"]
    if not wait:
        return subprocess.Popen(
            command, env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    return subprocess.run(command, env=base, capture_output=True, text=True, timeout=300)


def error_of(result) -> str:
    assert "error:" not in result.stdout
    assert result.stderr.startswith("exporter: error: "), result.stderr
    assert result.stderr.count("\n") == 1, result.stderr  # one line, no traceback
    return result.stderr.removeprefix("exporter: error: ").rstrip("\n")


def output_bytes(trained: Path) -> dict[str, bytes]:
    return {rel: (trained / "output" / rel).read_bytes() for rel in EXPORTED}


def assert_same_as_output(directory: Path, trained: Path) -> None:
    for rel, data in output_bytes(trained).items():
        assert (directory / rel).read_bytes() == data, rel
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    assert sorted(manifest["files"]) == EXPORTED
    for rel, record in manifest["files"].items():
        data = (directory / rel).read_bytes()
        assert record == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


# --- a directory ---------------------------------------------------------------------------------


def test_export_to_a_directory_rerun_and_download(trained, tmp_path):
    dest = tmp_path / "exports" / "run-1"
    done = run_export(trained, tmp_path, str(dest))
    assert done.returncode == 0, done.stderr
    assert_same_as_output(dest, trained)
    manifest = json.loads((dest / MANIFEST_FILE).read_text())
    assert (manifest["kind"], manifest["artifact"], manifest["method"]) == (
        "export",
        "adapter",
        "lora",
    )
    assert sorted(p.name for p in dest.parent.iterdir()) == ["run-1"]  # no partial left

    again = run_export(trained, tmp_path, f"file://{dest}")
    assert again.returncode == 0, again.stderr
    assert "already holds this export" in again.stdout

    logs: list[str] = []
    fetch_export(str(dest), tmp_path / "got", logs.append)
    assert_same_as_output(tmp_path / "got", trained)


def test_nothing_to_export_and_bad_destinations(tmp_path, trained):
    empty = tmp_path / "empty-ws"
    (empty / "output").mkdir(parents=True)
    done = run_export(empty, tmp_path, str(tmp_path / "out"))
    assert done.returncode == EXIT_BAD_INPUT
    assert error_of(done) == (
        f"there is no finished result to export: {empty}/output/result.json does not exist (the "
        "trainer writes it when training completes); run the training first"
    )
    assert not (tmp_path / "out").exists()

    done = run_export(trained, tmp_path, "https://example.com/x")
    assert error_of(done) == (
        "cannot export to 'https://example.com/x': expected s3://bucket/prefix, hf://org/name, "
        "file:///absolute/path or a path (https:// is read-only)"
    )
    done = run_export(trained, tmp_path, "hf://datasets/org/data")
    assert error_of(done) == (
        "cannot export to 'hf://datasets/org/data': a result goes to a model repository, "
        "written hf://org/name (or hf://org/name@branch), with no sub-path or options"
    )
    done = run_export(trained, tmp_path, "s3://bucket-x")
    assert error_of(done) == (
        "export URI 's3://bucket-x' names no prefix; write s3://bucket/prefix so the result has "
        "a directory of its own"
    )

    # A directory of someone else's files is never replaced.
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    done = run_export(trained, tmp_path, str(theirs))
    assert done.returncode == EXIT_BAD_INPUT
    assert "holds files that tunepack did not write" in error_of(done)
    assert [p.name for p in theirs.iterdir()] == ["notes.txt"]


def test_unset_export_uri_is_nothing_to_do(trained, tmp_path):
    done = run_export(trained, tmp_path, "")
    assert done.returncode == 0
    assert done.stdout == "exporter: EXPORT_URI is not set: nothing to export\n"


def test_fetching_an_incomplete_export_is_refused(tmp_path):
    partial = tmp_path / "half"
    (partial / "adapter").mkdir(parents=True)
    (partial / "adapter" / "adapter_config.json").write_text("{}")
    with pytest.raises(NotFoundError) as err:
        fetch_export(str(partial), tmp_path / "got", print)
    assert str(err.value) == (
        f"'{partial}' holds no complete tunepack export (no tunepack-manifest.json): the "
        "export did not finish, or it was never made; run the export again"
    )
    assert not (tmp_path / "got").exists()


# --- S3 (moto, IAM enforced) ---------------------------------------------------------------------


class _Recorder(BaseHTTPRequestHandler):
    """A reverse proxy to moto that records every request and can hold one (never answer it),
    so a test can kill the exporter in the middle of an upload."""

    protocol_version = "HTTP/1.1"
    upstream: tuple[str, int]
    seen: list[tuple[str, str]]
    hold: list  # predicates (method, path) -> bool
    held: threading.Event

    def log_message(self, *args):
        pass

    def _relay(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.seen.append((self.command, self.path))
        if any(pred(self.command, self.path) for pred in self.hold):
            self.held.set()
            threading.Event().wait(600)  # the client is killed meanwhile
            return
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        conn.request(self.command, self.path, body=body, headers=dict(self.headers))
        answer = conn.getresponse()
        data = answer.read()
        self.send_response(answer.status)
        for key, value in answer.getheaders():
            if key.lower() in ("transfer-encoding", "connection"):
                continue
            if key.lower() != "content-length" or self.command == "HEAD":
                self.send_header(key, value)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        conn.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's server with IAM enforced, one user allowed everything, and a recording proxy."""
    import boto3
    import requests
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    requests.post(f"{url}/moto-api/reset-auth", data=b"3", timeout=10).raise_for_status()
    iam = boto3.client(
        "iam",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id="bootstrap",
        aws_secret_access_key="bootstrap",
    )
    iam.create_user(UserName="exporter")  # the 3 requests before IAM is enforced
    key = iam.create_access_key(UserName="exporter")["AccessKey"]
    policy = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
    }
    iam.put_user_policy(UserName="exporter", PolicyName="all", PolicyDocument=json.dumps(policy))
    creds = {
        "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
        "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
        "AWS_REGION": "us-east-1",
    }
    client = boto3.client(
        "s3",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id=creds["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=creds["AWS_SECRET_ACCESS_KEY"],
    )
    client.create_bucket(Bucket="results")

    class Handler(_Recorder):
        pass

    Handler.upstream, Handler.seen, Handler.hold = (host, port), [], []
    Handler.held = threading.Event()
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    proxy.daemon_threads = True
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    yield {
        "url": url,
        "proxy": f"http://127.0.0.1:{proxy.server_address[1]}",
        "handler": Handler,
        "creds": creds,
        "client": client,
    }
    proxy.shutdown()
    requests.post(f"{url}/moto-api/reset-auth", data=b"inf", timeout=10)
    server.stop()


def s3_env(s3, endpoint=None, **extra) -> dict[str, str]:
    return {
        "AWS_ENDPOINT_URL": endpoint or s3["url"],
        "TUNEPACK_EXPORT_PART_SIZE_MB": "5",
        **s3["creds"],
        **extra,
    }


@contextlib.contextmanager
def s3_environ(s3):
    """This process's environment pointed at moto, for fetch_export (as a notebook's would be)."""
    env = s3_env(s3)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def keys(s3, prefix: str) -> list[str]:
    listed = s3["client"].list_objects_v2(Bucket="results", Prefix=prefix + "/")
    return sorted(o["Key"][len(prefix) + 1 :] for o in listed.get("Contents", []))


def test_s3_export_is_verified_manifest_last_rerun_and_download(s3, trained, tmp_path):
    s3["handler"].seen.clear()
    done = run_export(trained, tmp_path, "s3://results/runs/one", s3_env(s3, s3["proxy"]))
    assert done.returncode == 0, done.stderr
    assert keys(s3, "runs/one") == sorted([*EXPORTED, MANIFEST_FILE])
    seen = s3["handler"].seen
    writes = [path for method, path in seen if method in ("PUT", "POST")]
    # Every file (the adapter as a 2-part upload) before the manifest, which comes last.
    assert writes[-1] == f"/results/runs/one/{MANIFEST_FILE}"
    parts = [p for p in writes if "adapter_model.safetensors" in p and "partNumber=" in p]
    size = len(output_bytes(trained)["adapter/adapter_model.safetensors"])
    assert len(parts) == -(-size // (5 << 20)) > 1
    # Each upload is read back (HEAD) before the next one starts.
    heads = [path for method, path in seen if method == "HEAD"]
    for rel in EXPORTED:
        assert f"/results/runs/one/{rel}" in heads
    for text in (done.stdout, done.stderr):
        assert s3["creds"]["AWS_SECRET_ACCESS_KEY"] not in text
    assert "exported to s3://results/runs/one: 5 files uploaded" in done.stdout

    s3["handler"].seen.clear()
    again = run_export(trained, tmp_path, "s3://results/runs/one", s3_env(s3, s3["proxy"]))
    assert again.returncode == 0, again.stderr
    assert "already holds this export" in again.stdout
    assert [m for m, _ in s3["handler"].seen if m in ("PUT", "POST", "DELETE")] == []

    with s3_environ(s3):
        fetch_export("s3://results/runs/one", tmp_path / "got", print)
    assert_same_as_output(tmp_path / "got", trained)


def _kill_9_once_held(proc, held, release, what: str) -> None:
    """SIGKILL the exporter once the server holds its upload (``held`` is set), then ``release``
    the server; the exporter is gone either way."""
    try:
        assert held.wait(120), f"the exporter never {what}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        release()
        if proc.poll() is None:
            proc.kill()


def test_s3_kill_9_mid_upload_then_rerun_finishes_without_resending(s3, trained, tmp_path):
    handler = s3["handler"]
    handler.seen.clear()
    handler.held.clear()
    handler.hold[:] = [lambda m, p: m == "PUT" and "safetensors" in p and "partNumber=2" in p]
    proc = run_export(trained, tmp_path, "s3://results/runs/kill", s3_env(s3, s3["proxy"]), False)
    _kill_9_once_held(proc, handler.held, handler.hold.clear, "reached part 2")
    assert proc.returncode == -signal.SIGKILL
    # Nothing is a result yet: no manifest, and the adapter is not visible at all.
    assert keys(s3, "runs/kill") == ["adapter/adapter_config.json"]
    uploads = s3["client"].list_multipart_uploads(Bucket="results", Prefix="runs/kill/")
    assert len(uploads["Uploads"]) == 1
    with s3_environ(s3), pytest.raises(NotFoundError) as err:
        fetch_export("s3://results/runs/kill", tmp_path / "early", print)
    assert "holds no complete tunepack export (no tunepack-manifest.json)" in str(err.value)
    assert not (tmp_path / "early").exists()

    done = run_export(trained, tmp_path, "s3://results/runs/kill", s3_env(s3, s3["proxy"]))
    assert done.returncode == 0, done.stderr
    assert "adapter/adapter_config.json is already there" in done.stdout
    assert "resumed the upload of adapter/adapter_model.safetensors: 1 of " in done.stdout
    assert keys(s3, "runs/kill") == sorted([*EXPORTED, MANIFEST_FILE])
    puts = [p for m, p in handler.seen if m == "PUT"]
    # Over both runs: the config once, part 1 once (part 2 twice: the held one never arrived).
    assert puts.count("/results/runs/kill/adapter/adapter_config.json") == 1
    part = "/results/runs/kill/adapter/adapter_model.safetensors?"
    assert len([p for p in puts if p.startswith(part) and "partNumber=1&" in p + "&"]) == 1
    assert (
        not s3["client"]
        .list_multipart_uploads(Bucket="results", Prefix="runs/kill/")
        .get("Uploads")
    )
    body = s3["client"].get_object(
        Bucket="results", Key="runs/kill/adapter/adapter_model.safetensors"
    )
    assert body["Body"].read() == output_bytes(trained)["adapter/adapter_model.safetensors"]


def test_s3_wrong_credentials_exit_65_in_one_line_and_nothing_visible(s3, trained, tmp_path):
    env = s3_env(s3, AWS_SECRET_ACCESS_KEY=SECRET)
    done = run_export(trained, tmp_path, "s3://results/runs/denied", env)
    assert done.returncode == EXIT_BAD_INPUT
    assert error_of(done) == (
        "S3 rejected the credentials for 's3://results/runs/denied' (SignatureDoesNotMatch); "
        "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (in a cluster: the Secret "
        "tunepack-s3-credentials) or give the Pod an IAM role"
    )
    assert SECRET not in done.stdout + done.stderr
    assert keys(s3, "runs/denied") == []

    env = s3_env(s3, AWS_ACCESS_KEY_ID="AKIANOSUCHKEY0000000")
    done = run_export(trained, tmp_path, "s3://results/runs/denied", env)
    assert done.returncode == EXIT_BAD_INPUT
    assert "(InvalidAccessKeyId)" in error_of(done)
    assert keys(s3, "runs/denied") == []
    with s3_environ(s3), pytest.raises(NotFoundError) as err:
        fetch_export("s3://results/runs/denied", tmp_path / "got", print)
    assert str(err.value) == (
        "'s3://results/runs/denied' holds no complete tunepack export (no "
        "tunepack-manifest.json): the export did not finish, or it was never made; run the "
        "export again"
    )


def test_s3_re_export_of_another_result_removes_the_old_manifest_first(s3, trained, tmp_path):
    """A destination that held an earlier export has no manifest while the new one uploads."""
    handler = s3["handler"]
    done = run_export(trained, tmp_path, "s3://results/runs/again", s3_env(s3, s3["proxy"]))
    assert done.returncode == 0, done.stderr
    s3["client"].put_object(
        Bucket="results",
        Key=f"runs/again/{MANIFEST_FILE}",
        Body=json.dumps({"kind": "export", "files": {"x": {"size": 1, "sha256": "0"}}}).encode(),
    )
    handler.seen.clear()
    done = run_export(trained, tmp_path, "s3://results/runs/again", s3_env(s3, s3["proxy"]))
    assert done.returncode == 0, done.stderr
    writes = [(m, p) for m, p in handler.seen if m in ("PUT", "DELETE")]
    assert writes[0] == ("DELETE", f"/results/runs/again/{MANIFEST_FILE}")
    assert writes[-1] == ("PUT", f"/results/runs/again/{MANIFEST_FILE}")
    assert "5 files uploaded (0 B), 0 already there" not in done.stdout
    assert "0 files uploaded (0 B), 5 already there and verified" in done.stdout


# --- the Hub (tests/fakehub.py) ------------------------------------------------------------------


@pytest.fixture
def hub():
    hub = FakeHub(tokens=(READ_TOKEN,), write_tokens=(TOKEN,)).start()
    yield hub
    hub.stop()


def test_hub_export_private_one_commit_verified_rerun_and_download(hub, trained, tmp_path):
    env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN}
    done = run_export(trained, tmp_path, "hf://acme/tiny-lora", env)
    assert done.returncode == 0, done.stderr
    repo = hub.repos[("model", "acme/tiny-lora")]
    assert repo.private
    assert len(hub.commits) == 1
    assert sorted(repo.files) == sorted([*EXPORTED, MANIFEST_FILE])
    for rel, data in output_bytes(trained).items():
        assert repo.files[rel] == data
    assert f"in commit {repo.commit} (private), verified" in done.stdout
    assert TOKEN not in done.stdout + done.stderr

    again = run_export(trained, tmp_path, "hf://acme/tiny-lora", env)
    assert again.returncode == 0, again.stderr
    assert f"already holds this export (commit {repo.commit}, verified)" in again.stdout
    assert len(hub.commits) == 1

    os.environ.update(env)
    try:
        fetch_export("hf://acme/tiny-lora", tmp_path / "got", print)
    finally:
        for k in env:
            os.environ.pop(k)
    assert_same_as_output(tmp_path / "got", trained)


def test_hub_kill_9_mid_upload_then_rerun_commits_once_without_resending(hub, trained, tmp_path):
    env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "EXPORT_PRIVATE": "false"}
    hub.hold_uploads.set()
    proc = run_export(trained, tmp_path, "hf://acme/killed", env, wait=False)
    _kill_9_once_held(proc, hub.upload_held, hub.hold_uploads.clear, "started its LFS upload")
    repo = hub.repos[("model", "acme/killed")]
    assert repo.files == {} and hub.commits == []  # nothing half-visible

    done = run_export(trained, tmp_path, "hf://acme/killed", env)
    assert done.returncode == 0, done.stderr
    assert not repo.private  # EXPORT_PRIVATE=false
    assert len(hub.commits) == 1
    assert sorted(repo.files) == sorted([*EXPORTED, MANIFEST_FILE])
    uploads = [r for r in hub.requests if r["method"] == "PUT"]
    # The held upload was received before the kill, so the re-run sends no LFS bytes again.
    assert len(uploads) == 1


def test_hub_upload_refused_is_one_line_and_no_commit(hub, trained, tmp_path):
    hub.upload_errors.append(400)  # e.g. an expired upload URL: huggingface_hub does not retry it
    env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN}
    done = run_export(trained, tmp_path, "hf://acme/refused", env)
    assert done.returncode == EXIT_BAD_INPUT
    assert error_of(done) == (
        "the hub answered HTTP 400 for hub model repository 'acme/refused'; check "
        "'hf://acme/refused'"
    )
    assert hub.commits == [] and hub.repos[("model", "acme/refused")].files == {}


def test_hub_wrong_or_read_only_token_exit_65_in_one_line(hub, trained, tmp_path):
    done = run_export(
        trained,
        tmp_path,
        "hf://acme/x",
        {"HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_wrong_token_1234"},
    )
    assert done.returncode == EXIT_BAD_INPUT
    assert error_of(done) == (
        "the hub rejected the token given for 'hf://acme/x' (401 Unauthorized); create a token "
        "with write access and set HF_TOKEN (in a cluster: the Secret tunepack-hub-token, key "
        "token)"
    )
    assert "hf_wrong_token_1234" not in done.stdout + done.stderr
    done = run_export(
        trained, tmp_path, "hf://acme/x", {"HF_ENDPOINT": hub.url, "HF_TOKEN": READ_TOKEN}
    )
    assert done.returncode == EXIT_BAD_INPUT
    assert error_of(done) == (
        "the hub denied writing to hub model repository 'acme/x' (403 Forbidden); give the "
        "token write access to 'acme' and set HF_TOKEN (in a cluster: the Secret "
        "tunepack-hub-token, key token)"
    )
    done = run_export(trained, tmp_path, "hf://acme/x", {"HF_ENDPOINT": hub.url})
    assert error_of(done) == (
        "exporting to 'hf://acme/x' needs a hub token with write access; set HF_TOKEN (in a "
        "cluster: the Secret tunepack-hub-token, key token)"
    )
    assert ("model", "acme/x") not in hub.repos and hub.commits == []


# --- through the local backend: the CLI and the SDK ----------------------------------------------


def _train_local(model_dir: Path, dataset_file: Path, ws: Path, name: str) -> list[str]:
    """`tunepack train --local` of the tiny model into ``ws`` as job ``name`` (add arguments)."""
    return ["train", "--local", "--runtime", "tiny-llama3", "--dataset", str(dataset_file),
            "--model", str(model_dir), "--workspace", str(ws), "--name", name]  # fmt: skip


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tunepack.cli", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def _loads_with_peft(adapter: Path, base: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    assert type(model).__name__ == "PeftModelForCausalLM"


def test_cli_local_run_exports_to_s3_wrong_credentials_first(
    s3, tiny_model_dir, tiny_dataset_file, tmp_path
):
    train = [
        *_train_local(tiny_model_dir, tiny_dataset_file, tmp_path / "ws", "cli-export"),
        "--export",
        "s3://results/cli/run",
        "max_steps=4",
    ]
    wrong = _cli(*train, env=s3_env(s3, AWS_SECRET_ACCESS_KEY=SECRET))
    assert wrong.returncode == EXIT_BAD_INPUT, wrong.stdout + wrong.stderr
    assert "step 'exporter' failed with exit code 65" in wrong.stderr
    assert "exporter: error: S3 rejected the credentials for 's3://results/cli/run'" in (
        wrong.stderr
    )
    assert SECRET not in wrong.stdout + wrong.stderr
    assert keys(s3, "cli/run") == []

    done = _cli(*train, env=s3_env(s3))  # the same command: the trainer has nothing left to do
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[exporter] exporter: exported to s3://results/cli/run" in done.stdout
    assert "exported    s3://results/cli/run (tunepack download cli-export DIR)" in done.stdout

    got = _cli("download", "cli-export", str(tmp_path / "got"), "--local", env=s3_env(s3))
    assert got.returncode == 0, got.stderr
    workspace_output = tmp_path / "ws" / "output"
    for rel in EXPORTED:
        assert (tmp_path / "got" / rel).read_bytes() == (workspace_output / rel).read_bytes()
    result = json.loads((tmp_path / "got" / "result.json").read_text())
    assert result["final_loss"] < result["first_loss"]
    _loads_with_peft(tmp_path / "got" / "adapter", tiny_model_dir)


def test_sdk_local_run_exports_to_the_hub_and_downloads(
    hub, tiny_model_dir, tiny_dataset_file, tmp_path, monkeypatch
):
    from tunepack import FineTune, Initializer, LocalBackendConfig, TrainingClient

    for key, value in {
        "HF_ENDPOINT": hub.url,
        "HF_TOKEN": TOKEN,
        "HF_HUB_DISABLE_XET": "1",
        "HF_HOME": str(tmp_path / "hf-home"),
    }.items():
        monkeypatch.setenv(key, value)  # the runner and its steps inherit the notebook's env
    client = TrainingClient(LocalBackendConfig(root_dir=str(tmp_path / "jobs")))
    name = client.train(
        runtime="tunepack-tiny-llama3",
        initializer=Initializer(dataset=str(tiny_dataset_file), model=str(tiny_model_dir)),
        trainer=FineTune(method="lora", max_steps=4, export="hf://acme/sdk-lora"),
    )
    job = client.wait_for_job_status(name, timeout=600, polling_interval=1)
    assert [s.name for s in job.steps] == [
        "dataset-initializer",
        "model-initializer",
        "node-0",
        "exporter",
    ]
    repo = hub.repos[("model", "acme/sdk-lora")]
    assert repo.private and len(hub.commits) == 1
    result = client.result(name)
    assert result.export == "hf://acme/sdk-lora"
    path = result.download(tmp_path / "got")
    assert json.loads((path / MANIFEST_FILE).read_text())["files"].keys() == set(EXPORTED)
    for rel in EXPORTED:
        assert (path / rel).read_bytes() == repo.files[rel]
    _loads_with_peft(path / "adapter", tiny_model_dir)


def test_finetune_export_values_are_checked_in_the_notebook():
    from tunepack import FineTune

    with pytest.raises(BadValueError) as err:
        FineTune(export="ftp://host/x")
    assert str(err.value) == (
        "FineTune.export: cannot export to 'ftp://host/x': expected s3://bucket/prefix, "
        "hf://org/name, file:///absolute/path or a path (https:// is read-only)"
    )
    with pytest.raises(ConflictError) as err:
        FineTune(export_secret="creds")
    assert "export_secret names the exporter's credentials, but export is not set" in str(err.value)


def test_download_of_a_job_without_export_says_where_its_result_is(trained, tmp_path):
    done = _cli("download", "export-src", str(tmp_path / "got"), "--local", env={})
    assert done.returncode == EXIT_BAD_INPUT
    assert done.stderr == (
        "tunepack: error: TrainJob export-src was not exported, so there is nothing to download: "
        "train with FineTune(export='s3://bucket/prefix') (tunepack train --export URI); the "
        f"local result is at {trained / 'output' / 'adapter'}\n"
    )
    assert not (tmp_path / "got").exists()


def test_the_trainjob_carries_the_export_in_a_runtime_patch():
    from tunepack.jobs.trainjob import TrainJobSpec, build_trainjob, export_of

    def build(*args, **kwargs) -> dict:
        return build_trainjob(TrainJobSpec(*args, **kwargs))

    job = build(
        "exp-1",
        "tiny-llama3",
        "/data/train.jsonl",
        "/models/tiny",
        ["max_steps=4"],
        export_uri="hf://acme/lora",
        export_secret="export-creds",
    )
    (patch,) = job["spec"]["runtimePatches"]
    assert patch["manager"] == "tunepack.dev/export"
    (rjob,) = replicated_jobs(patch)
    (c,) = containers(rjob)
    assert (rjob["name"], c["name"]) == ("exporter", "exporter")
    assert c["env"][0] == {"name": "EXPORT_URI", "value": "hf://acme/lora"}
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"][1:]}
    assert refs["HF_TOKEN"] == {"name": "export-creds", "key": "HF_TOKEN", "optional": True}
    assert set(refs) >= {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"}
    assert export_of(job) == "hf://acme/lora"
    assert export_of(build("exp-2", "tiny-llama3", "/d.jsonl", "/m", [])) is None

    with pytest.raises(BadValueError) as err:
        build("exp-3", "tiny-llama3", "/d.jsonl", "/m", [], export_uri="out/run")
    assert str(err.value) == (
        "export path 'out/run' is relative: on a cluster the exporter writes it inside its Pod, "
        "so give an absolute path on a volume mounted there, or s3://bucket/prefix or "
        "hf://org/name"
    )
    local = build("exp-4", "tiny-llama3", "/d.jsonl", "/m", [], export_uri="out/run", local=True)
    assert export_of(local) == str(Path("out/run").absolute())


def test_render_trainjob_with_export(tmp_path):
    done = _cli(
        "render",
        "trainjob",
        "--runtime",
        "tiny-llama3",
        "--dataset",
        "/data/train.jsonl",
        "--model",
        "/models/tiny",
        "--name",
        "exp-yaml",
        "--export",
        "s3://results/exp-yaml",
        "--export-secret",
        "export-creds",
        env={},
    )
    assert done.returncode == 0, done.stderr
    import yaml

    from tunepack.jobs.trainjob import export_of

    assert export_of(yaml.safe_load(done.stdout)) == "s3://results/exp-yaml"


def test_hub_export_changed_since_is_committed_again(hub, trained, tmp_path):
    env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN}
    assert run_export(trained, tmp_path, "hf://acme/changed", env).returncode == 0
    repo = hub.repos[("model", "acme/changed")]
    repo.files["config.yaml"] = b"edited on the hub\n"  # the manifest still names the original
    again = run_export(trained, tmp_path, "hf://acme/changed", env)
    assert again.returncode == 0, again.stderr
    assert "no longer matches" in again.stdout and len(hub.commits) == 2
    assert repo.files["config.yaml"] == output_bytes(trained)["config.yaml"]


def test_a_merged_model_is_exported_with_the_adapter(tiny_model_dir, tiny_dataset_file, tmp_path):
    ws = tmp_path / "ws"
    done = _cli(
        *_train_local(tiny_model_dir, tiny_dataset_file, ws, "merged-export"),
        "--export",
        str(tmp_path / "out"),
        "merge=true",
        "max_steps=4",
        env={},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    manifest = json.loads((tmp_path / "out" / MANIFEST_FILE).read_text())
    assert (manifest["artifact"], manifest["merged_model"]) == ("adapter", "merged")
    merged = sorted(rel for rel in manifest["files"] if rel.startswith("merged/"))
    assert "merged/config.json" in merged and any(r.endswith(".safetensors") for r in merged)
    for rel in manifest["files"]:
        assert (tmp_path / "out" / rel).read_bytes() == (ws / "output" / rel).read_bytes()
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "merged")
