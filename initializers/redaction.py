"""Keeping secrets out of logs, error messages and manifests.

URIs are redacted where they are formatted (``uri.redact``). This module is the last line of
defence for text that tunepack did not write itself, such as a library's exception message that
echoes a request: every line an initializer prints passes through ``scrub``.
"""

from __future__ import annotations

import os

# Environment variables whose values are credentials. Their values are replaced wherever they
# appear in printed text, whatever the library that put them there.
SECRET_ENV = (
    "HF_TOKEN",
    "ACCESS_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ACCESS_KEY_ID",
    "HTTPS_PASSWORD",
)
HIDDEN = "***"
# Shorter values would also match ordinary words ("a", "ab"); real credentials are long.
_MIN_SECRET_LEN = 6


def secret_values() -> list[str]:
    values = {os.environ.get(name, "").strip() for name in SECRET_ENV}
    # Longest first, so a secret containing another is replaced whole.
    return sorted((v for v in values if len(v) >= _MIN_SECRET_LEN), key=len, reverse=True)


def scrub(text: str) -> str:
    for value in secret_values():
        text = text.replace(value, HIDDEN)
    return text
