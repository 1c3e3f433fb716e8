"""Remote sources end to end: the initializers as subprocesses against loopback servers.

hf:// runs against tests/fakehub.py, s3:// against moto's server mode, https:// against a local
HTTP server; nothing leaves the machine.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from functools import partial
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread

import pytest

from tests.fakehub import FakeHub, Repo
from tunepack.core.errors import EXIT_BAD_INPUT, EXIT_TRANSIENT, DiskFullError
from tunepack.core.workspace import MANIFEST_FILE
from tunepack.runtimes import catalog

TOKEN = "hf_fake_secret_0123456789"
TINY = catalog.get("tiny-llama3")
ROWS = [{"instruction": f"Say {i}.", "output": str(i)} for i in range(6)]


# --- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_files(tiny_model_dir) -> dict[str, bytes]:
    files = {
        p.relative_to(tiny_model_dir).as_posix(): p.read_bytes()
        for p in tiny_model_dir.rglob("*")
        if p.is_file()
    }
    files["pytorch_model.bin"] = b"a pickle that must not be downloaded by default"
    files[".gitattributes"] = b"*.safetensors filter=lfs\n"
    return files


@pytest.fixture
def hub(model_files):
    hub = FakeHub(tokens=(TOKEN,)).start()
    hub.add(Repo("tunepack/tiny-llama3", dict(model_files)))
    yield hub
    hub.stop()


def run_init(program, tmp_path, storage_uri, env=None, timeout=60, wait=True):
    """Run an initializer as the local backend does, with a clean credential environment."""
    drop = {"STORAGE_URI", "TUNEPACK_MODEL", "HF_TOKEN", "ACCESS_TOKEN", "HF_ENDPOINT"}
    base = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("AWS_")}
    base.update(
        TUNEPACK_WORKSPACE=str(tmp_path / "ws"),
        TUNEPACK_MODEL="tiny-llama3",
        STORAGE_URI=storage_uri,
        HF_HOME=str(tmp_path / "hf-home"),  # no login token from the machine
        TUNEPACK_RETRY_BACKOFF_SECONDS="0.01",
        AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE=str(tmp_path / "no-aws-config"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-aws-credentials"),
        **(env or {}),
    )
    tmp_path.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", f"tunepack.initializers.{program}"]
    if not wait:
        return subprocess.Popen(
            command,
            env=base,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    return subprocess.run(
        command, env=base, cwd=tmp_path, capture_output=True, text=True, timeout=timeout
    )


def error_of(result, program="model") -> str:
    assert result.stdout.count("error:") == 0
    prefix = f"{program}-initializer: error: "
    assert result.stderr.startswith(prefix), result.stderr
    return result.stderr[len(prefix) :].rstrip("\n")


def manifest_of(tmp_path, kind="model") -> dict:
    return json.loads((tmp_path / "ws" / kind / MANIFEST_FILE).read_text())


def workspace_entries(tmp_path) -> list[str]:
    ws = tmp_path / "ws"
    return sorted(p.name for p in ws.iterdir()) if ws.exists() else []


# --- hf:// models --------------------------------------------------------------------------------


def test_hf_model_download_verify_manifest_and_offline_rerun(tmp_path, hub, model_files):
    repo = hub.repos[("model", "tunepack/tiny-llama3")]
    result = run_init("model", tmp_path, "hf://tunepack/tiny-llama3", {"HF_ENDPOINT": hub.url})
    assert result.returncode == 0, result.stderr

    out = tmp_path / "ws" / "model"
    expected = sorted(p for p in model_files if p.endswith((".json", ".safetensors", ".model")))
    manifest = manifest_of(tmp_path)
    assert sorted(manifest["files"]) == expected
    assert (manifest["source"], manifest["revision"], manifest["commit"]) == (
        "hf://tunepack/tiny-llama3",
        "main",
        repo.commit,
    )
    for rel in expected:
        assert (out / rel).read_bytes() == model_files[rel]
        assert manifest["files"][rel]["sha256"] == hashlib.sha256(model_files[rel]).hexdigest()
    assert not (out / "pytorch_model.bin").exists()
    assert (
        "not downloading 3 files that ALLOW_PATTERNS/IGNORE_PATTERNS leave out: .gitattributes, "
        "README.md, pytorch_model.bin" in result.stdout
    )
    assert workspace_entries(tmp_path) == ["model"]  # the download cache is gone

    served = len(hub.requests)
    again = run_init("model", tmp_path, "hf://tunepack/tiny-llama3", {"HF_ENDPOINT": hub.url})
    assert again.returncode == 0, again.stderr
    assert len(hub.requests) == served  # no network traffic at all: nothing to wait for
    assert "already complete" in again.stdout

    # Pinning the commit is a different request: the model is rebuilt from that revision.
    pinned = run_init(
        "model", tmp_path, f"hf://tunepack/tiny-llama3@{repo.commit}", {"HF_ENDPOINT": hub.url}
    )
    assert pinned.returncode == 0, pinned.stderr
    assert "source changed (was 'hf://tunepack/tiny-llama3')" in pinned.stdout
    assert manifest_of(tmp_path)["revision"] == repo.commit


def test_hf_pickle_weights_only_when_allowed(tmp_path, hub):
    env = {"HF_ENDPOINT": hub.url, "ALLOW_PATTERNS": "*.bin,*.json"}
    result = run_init("model", tmp_path, "hf://tunepack/tiny-llama3", env)
    assert result.returncode == 0, result.stderr
    files = manifest_of(tmp_path)["files"]
    assert "pytorch_model.bin" in files
    assert "model.safetensors" in files  # required by the catalog, whatever the patterns
    assert "tokenizer_config.json" in files


def test_hf_gated_repo_needs_token_and_token_never_leaks(tmp_path, hub, model_files):
    hub.add(Repo("tunepack/gated", dict(model_files), gated=True))
    uri = "hf://tunepack/gated"
    denied = run_init("model", tmp_path, uri, {"HF_ENDPOINT": hub.url})
    assert denied.returncode == EXIT_BAD_INPUT
    assert error_of(denied) == (
        f"hub model repository 'tunepack/gated' is gated and no token was given: accept its "
        f"terms on {hub.url}/tunepack/gated with your account, then set HF_TOKEN (in a cluster: "
        f"the Secret tunepack-hub-token, key token)"
    )
    assert not any(r["method"] == "GET" and "resolve" in r["path"] for r in hub.requests)

    ok = run_init("model", tmp_path, uri, {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN})
    assert ok.returncode == 0, ok.stderr
    assert all(r["token"] == TOKEN for r in hub.requests if "resolve" in r["path"])
    written = "".join(p.read_text(errors="replace") for p in (tmp_path / "ws").rglob("*.json"))
    for text in (denied.stdout, denied.stderr, ok.stdout, ok.stderr, written):
        assert TOKEN not in text


def test_hf_rejected_token(tmp_path, hub):
    env = {"HF_ENDPOINT": hub.url, "ACCESS_TOKEN": "hf_wrong_token_value"}
    result = run_init("model", tmp_path, "hf://tunepack/tiny-llama3", env)
    assert result.returncode == EXIT_BAD_INPUT
    assert error_of(result) == (
        "the hub rejected the token given for hub model repository 'tunepack/tiny-llama3' (401 "
        "Unauthorized); create a new read token and set HF_TOKEN (in a cluster: the Secret "
        "tunepack-hub-token, key token)"
    )
    assert "hf_wrong_token_value" not in result.stdout + result.stderr


def test_hf_corrupt_file_fails_and_publishes_nothing(tmp_path, hub, model_files):
    repo = hub.repos[("model", "tunepack/tiny-llama3")]
    good = model_files["model.safetensors"]
    bad = bytes([good[0] ^ 1]) + good[1:]
    repo.corrupt["model.safetensors"] = bad
    result = run_init("model", tmp_path, "hf://tunepack/tiny-llama3", {"HF_ENDPOINT": hub.url})
    assert result.returncode == EXIT_BAD_INPUT
    assert error_of(result) == (
        f"model.safetensors from 'hf://tunepack/tiny-llama3' does not match its published "
        f"checksum twice in a row (sha256 is {hashlib.sha256(bad).hexdigest()}, expected "
        f"{hashlib.sha256(good).hexdigest()}); nothing was published. The copy at the source "
        f"may be corrupt: check it there or pin another revision"
    )
    assert len(hub.gets("model.safetensors")) == 2
    assert not (tmp_path / "ws" / "model").exists()


def test_hf_small_file_checked_against_git_blob_id(tmp_path, hub, model_files):
    repo = hub.repos[("model", "tunepack/tiny-llama3")]
    repo.corrupt["tokenizer.json"] = model_files["tokenizer.json"].replace(b"{", b"[", 1)
    result = run_init("model", tmp_path, "hf://tunepack/tiny-llama3", {"HF_ENDPOINT": hub.url})
    assert result.returncode == EXIT_BAD_INPUT
    assert "tokenizer.json from 'hf://tunepack/tiny-llama3' does not match" in result.stderr
    assert "git blob id is " in result.stderr
    assert not (tmp_path / "ws" / "model").exists()


def test_hf_missing_tokenizer_fails_before_downloading(tmp_path, hub, model_files):
    files = {k: v for k, v in model_files.items() if k != "original/tokenizer.model"}
    hub.add(Repo("tunepack/no-tokenizer", files))
    result = run_init("model", tmp_path, "hf://tunepack/no-tokenizer", {"HF_ENDPOINT": hub.url})
    assert result.returncode == EXIT_BAD_INPUT
    assert error_of(result) == (
        "model at 'hf://tunepack/no-tokenizer' is missing original/tokenizer.model, which the "
        "tiny-llama3 tokenizer needs. Point STORAGE_URI at a complete copy of "
        "tunepack/tiny-llama3"
    )
    assert not any("resolve" in r["path"] for r in hub.requests)


def test_hf_transient_errors_are_retried_then_exit_75(tmp_path, hub):
    repo = hub.repos[("model", "tunepack/tiny-llama3")]
    repo.fail["model.safetensors"] = 2
    result = run_init("model", tmp_path, "hf://tunepack/tiny-llama3", {"HF_ENDPOINT": hub.url})
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("failed (the hub answered HTTP 503); retry") == 2

    repo.fail["model.safetensors"] = 100
    env = {"HF_ENDPOINT": hub.url, "TUNEPACK_RETRIES": "3"}
    failed = run_init("model", tmp_path / "again", "hf://tunepack/tiny-llama3", env)
    assert failed.returncode == EXIT_TRANSIENT
    assert error_of(failed) == (
        "downloading model.safetensors from 'hf://tunepack/tiny-llama3' failed 3 times, last "
        "with: the hub answered HTTP 503. The network or the storage service may be down; the "
        "step exits 75 so it can be retried later"
    )


def test_hf_503_with_retry_after_waits_what_the_hub_asks(tmp_path, hub):
    repo = hub.repos[("model", "tunepack/tiny-llama3")]
    repo.fail["model.safetensors"] = 1
    repo.retry_after = "0"  # the subprocess waits for real: no time, but said and followed
    result = run_init("model", tmp_path, "hf://tunepack/tiny-llama3", {"HF_ENDPOINT": hub.url})
    assert result.returncode == 0, result.stderr
    assert (
        "model-initializer: downloading model.safetensors from 'hf://tunepack/tiny-llama3' "
        "failed (the hub answered HTTP 503); the server asked to retry after 0 s; retry 1 of 4 "
        "in 0.0 s"
    ) in result.stdout.splitlines()


def test_hf_unreachable_endpoint_is_transient(tmp_path):
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "TUNEPACK_RETRIES": "2"}
    result = run_init("model", tmp_path, "hf://tunepack/tiny-llama3", env)
    assert result.returncode == EXIT_TRANSIENT
    assert error_of(result).startswith(
        "listing 'hf://tunepack/tiny-llama3' failed 2 times, last with: ConnectError"
    )


def test_kill_9_mid_download_then_resume(tmp_path, hub, model_files):
    """kill -9 during the weights: the re-run resumes by range and skips complete files."""
    repo = hub.repos[("model", "tunepack/tiny-llama3")]
    weights = len(model_files["model.safetensors"])
    repo.hold_at["model.safetensors"] = weights // 2  # the rest waits for the kill
    env = {"HF_ENDPOINT": hub.url, "TUNEPACK_PROGRESS_SECONDS": "0.2"}
    proc = run_init("model", tmp_path, "hf://tunepack/tiny-llama3", env, wait=False)
    incomplete = tmp_path / "ws" / ".tunepack-downloads"
    deadline = time.monotonic() + 60  # bounds a broken download only: the hub holds the rest
    partial_size = 0
    while time.monotonic() < deadline:
        # The weights' part alone: the small files' parts, once counted in while they were still
        # downloading, made the figure larger than the offset the resume rightly starts from.
        parts = list(incomplete.glob("model-*/.incomplete/*"))
        partial_size = max((p.stat().st_size for p in parts if p.exists()), default=0)
        if partial_size > weights // 4:
            break
        time.sleep(0.05)
    # Periodic progress lines (stdout is a pipe, so no bar): bytes of total, rate, files. One is
    # read before the kill, so the kill cannot come before the first line however slow the run.
    progress = re.compile(
        r"model-initializer: downloaded [\d.]+ (KiB|MiB) of 1\.5 MiB \(\d+%\) at [\d.]+ "
        r"(B|KiB|MiB)/s, \d of 5 files complete"
    )
    read = ""
    for line in proc.stdout:
        read += line
        if progress.search(line):
            break
    os.kill(proc.pid, signal.SIGKILL)
    killed_stdout = read + proc.communicate()[0]
    assert progress.search(killed_stdout), killed_stdout
    assert weights // 4 < partial_size < weights
    assert not (tmp_path / "ws" / "model").exists()  # nothing half-published

    repo.hold_at.clear()
    before = {p: len(hub.gets(p)) for p in model_files}
    result = run_init("model", tmp_path, "hf://tunepack/tiny-llama3", {"HF_ENDPOINT": hub.url})
    assert result.returncode == 0, result.stderr
    resumed = hub.gets("model.safetensors")[-1]
    assert resumed["range"] is not None and int(resumed["range"][6:-1]) >= partial_size
    for small in ("tokenizer.json", "original/tokenizer.model", "tokenizer_config.json"):
        assert len(hub.gets(small)) == before[small]  # complete before the kill: not fetched again
    out = tmp_path / "ws" / "model"
    assert (out / "model.safetensors").read_bytes() == model_files["model.safetensors"]
    assert workspace_entries(tmp_path) == ["model"]


# --- hf:// datasets ------------------------------------------------------------------------------


def _parquet(rows: list[dict]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue()


@pytest.fixture
def dataset_hub(hub):
    chat = [
        {
            "messages": [
                {"role": "user", "content": f"hi {i}"},
                {"role": "assistant", "content": f"hello {i}"},
            ]
        }
        for i in range(4)
    ]
    hub.add(
        Repo(
            "org/chats",
            {
                "README.md": b"# chats",
                "data/train-00000-of-00002.parquet": _parquet(chat[:2]),
                "data/train-00001-of-00002.parquet": _parquet(chat[2:3]),
                "data/test-00000-of-00001.parquet": _parquet(chat[3:]),
            },
            repo_type="dataset",
        )
    )
    return hub


def test_dataset_initializer_reads_bare_hub_ids_as_dataset_repos(tmp_path, dataset_hub):
    """hf://org/name means a dataset repo to the dataset initializer, as in Kubeflow's own."""
    result = run_init("dataset", tmp_path, "hf://org/chats", {"HF_ENDPOINT": dataset_hub.url})
    assert result.returncode == 0, result.stderr
    manifest = manifest_of(tmp_path, "dataset")
    assert (manifest["schema"], manifest["rows"]) == ("chat", 3)
    assert manifest["commit"] == dataset_hub.repos[("dataset", "org/chats")].commit


def test_hf_dataset_splits(tmp_path, dataset_hub):
    env = {"HF_ENDPOINT": dataset_hub.url}
    result = run_init("dataset", tmp_path, "hf://datasets/org/chats", env)
    assert result.returncode == 0, result.stderr
    manifest = manifest_of(tmp_path, "dataset")
    assert (manifest["schema"], manifest["split"], manifest["rows"]) == ("chat", "train", 3)
    assert manifest["source_files"] == [
        "data/train-00000-of-00002.parquet",
        "data/train-00001-of-00002.parquet",
    ]
    assert manifest["commit"] == dataset_hub.repos[("dataset", "org/chats")].commit

    test = run_init("dataset", tmp_path, "hf://datasets/org/chats?split=test", env)
    assert test.returncode == 0, test.stderr
    lines = (tmp_path / "ws" / "dataset" / "train.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [
        {
            "messages": [
                {"role": "user", "content": "hi 3"},
                {"role": "assistant", "content": "hello 3"},
            ]
        }
    ]

    bad = run_init("dataset", tmp_path, "hf://datasets/org/chats", {**env, "DATASET_SPLIT": "dev"})
    assert bad.returncode == EXIT_BAD_INPUT
    assert error_of(bad, "dataset") == (
        "dataset 'hf://datasets/org/chats' has no 'dev' split; it has: test, train. Set "
        "DATASET_SPLIT or ?split= to one of them"
    )


# --- s3:// ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_server():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


S3_KEYS = {
    "AWS_ACCESS_KEY_ID": "AKIAFAKEFAKE",
    "AWS_SECRET_ACCESS_KEY": "fake/secret/key/123",
    "AWS_REGION": "us-east-1",
}


@pytest.fixture
def bucket(s3_server, model_files, request):
    import boto3

    name = "tp-" + hashlib.sha1(request.node.name.encode()).hexdigest()[:10]
    s3 = boto3.client(
        "s3",
        endpoint_url=s3_server,
        region_name="us-east-1",
        aws_access_key_id="x",
        aws_secret_access_key="y",
    )
    s3.create_bucket(Bucket=name)
    for rel, data in model_files.items():
        s3.put_object(Bucket=name, Key=f"models/tiny/{rel}", Body=data)
    body = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    s3.put_object(Bucket=name, Key="data/train.jsonl", Body=body)
    return name


def test_s3_model_and_rerun(tmp_path, s3_server, bucket, model_files):
    env = {"AWS_ENDPOINT_URL": s3_server, **S3_KEYS}
    uri = f"s3://{bucket}/models/tiny"
    result = run_init("model", tmp_path, uri, env)
    assert result.returncode == 0, result.stderr
    manifest = manifest_of(tmp_path)
    assert (
        manifest["files"]["model.safetensors"]["sha256"]
        == hashlib.sha256(model_files["model.safetensors"]).hexdigest()
    )
    assert "pytorch_model.bin" not in manifest["files"]
    for text in (result.stdout, result.stderr, json.dumps(manifest)):
        assert S3_KEYS["AWS_SECRET_ACCESS_KEY"] not in text
    again = run_init("model", tmp_path, uri, env)
    assert "already complete" in again.stdout


def test_s3_single_object_dataset_via_s3_endpoint_alias(tmp_path, s3_server, bucket):
    env = {"S3_ENDPOINT": s3_server, **S3_KEYS}
    result = run_init("dataset", tmp_path, f"s3://{bucket}/data/train.jsonl", env)
    assert result.returncode == 0, result.stderr
    assert manifest_of(tmp_path, "dataset")["rows"] == len(ROWS)


def test_s3_missing_credentials(tmp_path, s3_server, bucket):
    result = run_init(
        "model", tmp_path, f"s3://{bucket}/models/tiny", {"AWS_ENDPOINT_URL": s3_server}
    )
    assert result.returncode == EXIT_BAD_INPUT
    assert error_of(result) == (
        f"no AWS credentials were found for 's3://{bucket}/models/tiny'; set AWS_ACCESS_KEY_ID "
        f"and AWS_SECRET_ACCESS_KEY (in a cluster: the Secret tunepack-s3-credentials) or give "
        f"the Pod an IAM role"
    )


def test_s3_missing_bucket_and_empty_prefix(tmp_path, s3_server, bucket):
    env = {"AWS_ENDPOINT_URL": s3_server, **S3_KEYS}
    result = run_init("model", tmp_path, "s3://no-such-bucket-x/m", env)
    assert error_of(result) == (
        "bucket 'no-such-bucket-x' of 's3://no-such-bucket-x/m' does not exist; check the bucket "
        "name and AWS_ENDPOINT_URL"
    )
    result = run_init("model", tmp_path, f"s3://{bucket}/nothing/here", env)
    assert result.returncode == EXIT_BAD_INPUT
    assert error_of(result) == (
        f"S3 URI 's3://{bucket}/nothing/here' matches no objects (it not found); check the "
        f"bucket and prefix"
    )


class _Deny(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        body = b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
        self.send_response(403)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_HEAD = do_GET


@pytest.fixture
def http_server():
    servers = []

    def start(handler):
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_s3_access_denied(tmp_path, http_server):
    url = http_server(_Deny)
    result = run_init(
        "model", tmp_path, "s3://private-bucket/m", {"AWS_ENDPOINT_URL": url, **S3_KEYS}
    )
    assert result.returncode == EXIT_BAD_INPUT
    assert error_of(result) == (
        "access to 's3://private-bucket/m' was denied (403); grant the credentials or role "
        "s3:ListBucket and s3:GetObject on it"
    )


# --- https:// ------------------------------------------------------------------------------------


@pytest.fixture
def files_server(tmp_path, http_server):
    root = tmp_path / "served"
    root.mkdir()
    handler = partial(_QuietFiles, directory=str(root))
    return root, http_server(handler)


class _QuietFiles(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_https_single_file_with_checksum(tmp_path, files_server):
    root, url = files_server
    body = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    (root / "d.jsonl").write_bytes(body)
    digest = hashlib.sha256(body).hexdigest()
    result = run_init("dataset", tmp_path, f"{url}/d.jsonl#sha256={digest}")
    assert result.returncode == 0, result.stderr
    assert manifest_of(tmp_path, "dataset")["rows"] == len(ROWS)

    wrong = "0" * 64
    bad = run_init("dataset", tmp_path / "b", f"{url}/d.jsonl", {"STORAGE_SHA256": wrong})
    assert bad.returncode == EXIT_BAD_INPUT
    assert error_of(bad, "dataset") == (
        f"d.jsonl from '{url}/d.jsonl' does not match its published checksum twice in a row "
        f"(sha256 is {digest}, expected {wrong}); nothing was published. The copy at the source "
        f"may be corrupt: check it there or pin another revision"
    )


def test_https_archives(tmp_path, files_server, tiny_model_dir):
    root, url = files_server
    with tarfile.open(root / "model.tar.gz", "w:gz") as tf:
        for path in sorted(tiny_model_dir.rglob("*")):
            tf.add(path, arcname=path.relative_to(tiny_model_dir).as_posix(), recursive=False)
    result = run_init("model", tmp_path, f"{url}/model.tar.gz")
    assert result.returncode == 0, result.stderr
    assert "model.safetensors" in manifest_of(tmp_path)["files"]

    with zipfile.ZipFile(root / "data.zip", "w") as zf:
        zf.writestr("data/train.jsonl", "".join(json.dumps(r) + "\n" for r in ROWS))
        zf.writestr("data/test.jsonl", json.dumps(ROWS[0]) + "\n")
    result = run_init("dataset", tmp_path, f"{url}/data.zip")
    assert result.returncode == 0, result.stderr
    assert manifest_of(tmp_path, "dataset")["source_files"] == ["data/train.jsonl"]


@pytest.mark.parametrize(
    ("member", "problem"),
    [
        (
            "../../evil.jsonl",
            "contains '../../evil.jsonl', which would be extracted outside its "
            "directory; refusing to extract it. Repack the archive with relative paths",
        ),
        (
            "/etc/evil.jsonl",
            "contains '/etc/evil.jsonl', which would be extracted outside its "
            "directory; refusing to extract it. Repack the archive with relative paths",
        ),
    ],
)
def test_https_archive_path_traversal_is_refused(tmp_path, files_server, member, problem):
    root, url = files_server
    with zipfile.ZipFile(root / "evil.zip", "w") as zf:
        zf.writestr(member, json.dumps(ROWS[0]) + "\n")
    result = run_init("dataset", tmp_path, f"{url}/evil.zip")
    assert result.returncode == EXIT_BAD_INPUT
    assert error_of(result, "dataset") == f"archive '{url}/evil.zip' {problem}"
    assert not (tmp_path / "evil.jsonl").exists()
    # A refused archive leaves nothing behind: no dataset, no download cache.
    assert sorted(p.name for p in (tmp_path / "ws").iterdir()) == []


def _tar_with_a_link(path, member: str) -> None:
    """A tar archive whose only member is a symbolic link out of the extraction directory."""
    with tarfile.open(path, "w") as tf:
        info = tarfile.TarInfo(member)
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tf.addfile(info)


def test_https_tar_symlink_is_refused(tmp_path, files_server):
    root, url = files_server
    _tar_with_a_link(root / "link.tar", "train.jsonl")
    result = run_init("dataset", tmp_path, f"{url}/link.tar")
    assert result.returncode == EXIT_BAD_INPUT
    assert error_of(result, "dataset") == (
        f"archive '{url}/link.tar' contains a link 'train.jsonl'; tunepack extracts only regular "
        f"files and directories. Repack the archive without it"
    )
    assert sorted(p.name for p in (tmp_path / "ws").iterdir()) == []


def test_https_refused_model_archive_leaves_no_download_cache(tmp_path, files_server):
    root, url = files_server
    _tar_with_a_link(root / "model.tar", "config.json")
    result = run_init("model", tmp_path, f"{url}/model.tar")
    assert result.returncode == EXIT_BAD_INPUT
    assert error_of(result) == (
        f"archive '{url}/model.tar' contains a link 'config.json'; tunepack extracts only regular "
        f"files and directories. Repack the archive without it"
    )
    assert sorted(p.name for p in (tmp_path / "ws").iterdir()) == []


def test_a_full_disk_while_downloading_says_the_downloads_size(tmp_path, files_server, monkeypatch):
    from tunepack.initializers.transport import download, uri

    root, url = files_server
    (root / "d.jsonl").write_bytes(b"x" * 5000)
    source = uri.remote_source(uri.parse(f"{url}/d.jsonl"), "dataset")
    files = source.list().files
    assert [f.size for f in files] == [5000]

    def full(*_args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)  # the first write to reach the disk finds it full
    cache = tmp_path / "ws" / download.CACHE_ROOT / "dataset-x"
    with pytest.raises(DiskFullError) as err:
        download.fetch(source, files, cache, lambda _line: None)
    assert err.value.exit_code == EXIT_TRANSIENT
    assert str(err.value).startswith(
        f"no space left on the device (or quota) writing {cache} (4.9 KiB needed, "
    )
    assert str(err.value).endswith(" free): free space or enlarge the volume, then run again")


class _Throttled(_QuietFiles):
    """Answers a whole-file GET with ``status`` and ``Retry-After: <value>`` while ``answers``
    holds any; the listing's ranged GET (bytes=0-0) is served."""

    answers: list[tuple[int, str]] = []

    def do_GET(self):
        if self.headers.get("Range") is None and self.answers:
            status, value = self.answers.pop(0)
            self.send_response(status)
            self.send_header("Retry-After", value)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        super().do_GET()


class _FakeClock:
    """retry.CLOCK for a test: a fixed time, and waits recorded instead of slept."""

    def __init__(self, now: float):
        self.time, self.waits = now, []

    def now(self) -> float:
        return self.time

    def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.time += seconds


_NOW = 1_772_452_800.0  # 2026-03-02 12:00:00 GMT, the date in the Retry-After below


@pytest.mark.parametrize(
    ("status", "value", "wait", "said"),
    [
        (429, "2", 2.0, "; the server asked to retry after 2 s"),
        (503, "Mon, 02 Mar 2026 12:00:09 GMT", 9.0, "; the server asked to retry after 9 s"),
        (
            429,
            "86400",
            300.0,
            "; the server asked to retry after 86400 s, more than the 300 s waited at most",
        ),
        (
            429,
            "after lunch",
            0.01,  # TUNEPACK_RETRY_BACKOFF_SECONDS, unjittered
            "; its Retry-After is neither a number of seconds nor an HTTP date, so backing off "
            "as usual",
        ),
    ],
)
def test_https_download_waits_as_retry_after_says(
    tmp_path, http_server, monkeypatch, status, value, wait, said
):
    from tunepack.initializers.transport import download, retry, uri

    root = tmp_path / "served"
    root.mkdir()
    body = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    (root / "d.jsonl").write_bytes(body)
    handler = type("Throttled", (_Throttled,), {"answers": [(status, value)]})
    url = http_server(partial(handler, directory=str(root)))
    clock = _FakeClock(_NOW)
    monkeypatch.setattr(retry, "CLOCK", clock)
    monkeypatch.setattr(retry.random, "random", lambda: 1.0)
    monkeypatch.setenv(retry.BACKOFF_ENV, "0.01")
    lines: list[str] = []
    cache = tmp_path / "cache"
    source, listing = download.open_listing(
        uri.parse(f"{url}/d.jsonl"), "dataset", cache, lines.append
    )
    done = download.fetch(source, listing.files, cache, lines.append)

    assert clock.waits == [wait]
    assert lines[0] == (
        f"downloading d.jsonl from '{url}/d.jsonl' failed (the server answered HTTP {status})"
        f"{said}; retry 1 of 4 in {wait:.1f} s"
    )
    assert handler.answers == []
    assert (cache / "d.jsonl").read_bytes() == body
    assert done["d.jsonl"].size == len(body)


def test_https_not_found_and_single_file_model(tmp_path, files_server):
    root, url = files_server
    result = run_init("dataset", tmp_path, f"{url}/missing.jsonl")
    assert result.returncode == EXIT_BAD_INPUT
    assert error_of(result, "dataset") == (
        f"'{url}/missing.jsonl' answered 404: no such file; check the URL"
    )
    (root / "model.safetensors").write_bytes(b"x")
    result = run_init("model", tmp_path, f"{url}/model.safetensors")
    assert error_of(result) == (
        f"model at '{url}/model.safetensors' is a single file, but a model is a directory; give "
        f"a .tar, .tar.gz or .zip archive of it, an hf:// repository or an s3:// prefix"
    )
