"""The one way tunepack hashes a configuration: SHA-256 of its canonical JSON.

Canonical: keys sorted, ``json.dumps``' default separators, so two equal configurations (dicts
built in any order) get the same digest, in any process and any version of Python. Used for the
identity of a training run and of its result (trainers/config.py: a checkpoint or a finished
result belongs to the configuration with its digest) and for the default name of a local job
(the same command, the same job).
"""

from __future__ import annotations

import hashlib
import json


def json_digest(value: object) -> str:
    """The SHA-256 (hex) of ``value`` as canonical JSON (keys sorted)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()
