"""S3 as both the s3:// source (download) and the s3:// sink (export) use it: the client, built
from the environment, and the one mapping of its failures to tunepack's errors.

Configuration comes from the environment, as the AWS SDKs read it: ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` (/ ``AWS_SESSION_TOKEN``) or a role (IRSA, Pod Identity, instance
profile); ``AWS_REGION``; ``AWS_ENDPOINT_URL`` or ``S3_ENDPOINT`` for another store, which then
defaults to path-style addressing (``S3_ADDRESSING_STYLE`` overrides).
"""

from __future__ import annotations

import os

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    EndpointConnectionError,
    HTTPClientError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
    ResponseStreamingError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)
from urllib3.exceptions import HTTPError as Urllib3Error

from tunepack.core.errors import (
    BadInputError,
    DeniedError,
    NoObjectsError,
    NotFoundError,
    TransientError,
)
from tunepack.initializers.transport.retry import Retryable

ENDPOINT_ENVS = ("AWS_ENDPOINT_URL", "S3_ENDPOINT")
CREDENTIALS_HINT = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (in a cluster: the Secret "
    "tunepack-s3-credentials) or give the Pod an IAM role"
)
_RETRYABLE_CODES = frozenset(
    {
        "SlowDown",
        "InternalError",
        "ServiceUnavailable",
        "RequestTimeout",
        "Throttling",
        "ThrottlingException",
        "RequestTimeTooSkewed",
        "500",
        "502",
        "503",
        "504",
    }
)
_CREDENTIAL_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AuthorizationHeaderMalformed",
    }
)
_TRANSPORT_ERRORS = (
    EndpointConnectionError
    | BotoConnectionError
    | HTTPClientError
    | ReadTimeoutError
    | ResponseStreamingError
)
# What reading an object's body raises when the connection fails midway.
STREAM_ERRORS = (BotoCoreError, Urllib3Error, OSError)


def endpoint() -> str | None:
    for name in ENDPOINT_ENVS:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


def client(*, read_timeout: int, **config):
    """An S3 client for the store the environment names; ``config``: further ``botocore``
    ``Config`` settings."""
    url = endpoint()
    style = os.environ.get("S3_ADDRESSING_STYLE", "").strip() or ("path" if url else "auto")
    settings = Config(
        # tunepack retries (with its own logging and exit code), so botocore must not.
        retries={"total_max_attempts": 1},
        connect_timeout=10,
        read_timeout=read_timeout,
        s3={"addressing_style": style},
        **config,
    )
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None
    return boto3.session.Session().client(
        "s3", endpoint_url=url, region_name=region, config=settings
    )


def status(error: Exception) -> int | None:
    """The HTTP status of an S3 answer, or None (no answer, or not an S3 error)."""
    response = getattr(error, "response", None)
    if isinstance(response, dict):
        code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code if isinstance(code, int) else None
    return None


def problem(
    error: Exception,
    *,
    shown: str,
    bucket: str,
    key: str | None = None,
    writing: bool = False,
    streaming: bool = False,
) -> Exception:
    """What a failed S3 call means: ``BadInputError`` (the user must fix it), ``Retryable``,
    ``TransientError``, or ``error`` itself (a bug or an unexpected library failure: its
    traceback is kept).

    ``shown``: the URI as messages name it; ``key``: the object the call was about, when one;
    ``writing``: an export's call (the messages name the permissions to write); ``streaming``:
    the failure came while reading an object's body, where any library error is the network's.
    """
    if streaming and isinstance(error, STREAM_ERRORS):
        return Retryable(f"{type(error).__name__}: {error}")
    if isinstance(error, NoCredentialsError | PartialCredentialsError):
        return DeniedError(f"no AWS credentials were found for {shown!r}; {CREDENTIALS_HINT}")
    if isinstance(error, _TRANSPORT_ERRORS):
        return Retryable(f"{type(error).__name__}: {error}")
    if not isinstance(error, ClientError):
        return error
    code = str(error.response.get("Error", {}).get("Code", ""))
    http = status(error)
    if code in _RETRYABLE_CODES or (http is not None and http >= 500):
        return Retryable(f"S3 answered {code or http}")
    if code in _CREDENTIAL_CODES:
        return DeniedError(
            f"S3 rejected the credentials for {shown!r} ({code}); {CREDENTIALS_HINT}"
        )
    if code == "NoSuchBucket":
        create = "create it or " if writing else ""
        return NotFoundError(
            f"bucket {bucket!r} of {shown!r} does not exist; {create}check the bucket name "
            f"and AWS_ENDPOINT_URL",
            what="bucket",
            name=bucket,
        )
    if code in ("AccessDenied", "403", "AllAccessDisabled") or http == 403:
        if writing:
            return DeniedError(
                f"writing to {shown!r} was denied (403); grant the credentials or role "
                "s3:PutObject, s3:GetObject, s3:DeleteObject, s3:ListBucket and "
                "s3:ListBucketMultipartUploads on it"
            )
        return DeniedError(
            f"access to {shown!r} was denied (403); grant the credentials or role "
            f"s3:ListBucket and s3:GetObject on it"
        )
    if code in ("NoSuchKey", "404", "NotFound") or http == 404:
        what = f"object {key!r}" if key else "it"
        return NoObjectsError(
            f"S3 URI {shown!r} matches no objects ({what} not found); check the bucket and prefix",
            what="objects",
            name=shown,
        )
    if code in ("PreconditionFailed", "412") or http == 412:
        return TransientError(
            f"{key} in {shown!r} changed while it was being downloaded; the step exits 75 "
            f"so a retry downloads the new version"
        )
    if writing:
        return BadInputError(f"S3 answered {http} writing to {shown!r}")
    return BadInputError(f"S3 answered {code or http} for {shown!r}: {error}")
