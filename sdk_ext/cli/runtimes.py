"""What tunepack ships, and installing it: ``tunepack runtimes``, ``args`` and ``install``."""

from __future__ import annotations

import argparse
import sys

from tunepack.cli import output
from tunepack.cli.cluster import check_cluster, load_config


def cmd_runtimes(_: argparse.Namespace) -> int:
    from tunepack.runtimes.store import list_runtimes

    rows = [
        [
            r["name"],
            ",".join(r["methods"]),
            output.count(r["params"]) if r["params"] else "yours",
            r["gpus"],
            r["description"],
        ]
        for r in list_runtimes()
    ]
    print(output.table(rows, ["RUNTIME", "METHODS", "PARAMS", "GPUS", "DESCRIPTION"]))
    return 0


def cmd_args(_: argparse.Namespace) -> int:
    from tunepack.runtimes.args_docs import vocabulary_table

    print(output.table([list(r) for r in vocabulary_table()], ["KEY", "DEFAULT", "MEANING"]))
    return 0


def cmd_install(ns: argparse.Namespace) -> int:
    from kubernetes import client

    from tunepack.cli.cluster import backend_config
    from tunepack.core.errors import BadValueError, ImageNotPullable
    from tunepack.jobs.naming import check_dns_label
    from tunepack.tools import images
    from tunepack.tools.install import (
        admission_objects,
        describe,
        dry_run_text,
        install,
        runtime_objects,
    )

    if ns.namespace is not None:
        check_dns_label("--namespace", ns.namespace)
    if not ns.delete_timeout > 0:
        raise BadValueError(
            f"--delete-timeout {ns.delete_timeout:g} is not valid: expected a number of seconds > 0"
        )
    if not ns.image_check_timeout > 0:
        raise BadValueError(
            f"--image-check-timeout {ns.image_check_timeout:g} is not valid: expected a number "
            "of seconds > 0"
        )
    source = images.ImageSource.parse(ns.registry, ns.tag)
    objects = runtime_objects(ns.runtime or None, namespace=ns.namespace, images=source)
    objects += admission_objects(ns.namespace)
    if ns.dry_run:  # no cluster: nothing read, checked or sent
        sys.stdout.write(dry_run_text(objects))
        sys.stdout.flush()
        print(
            f"tunepack: dry run: {len(objects)} object{'s' if len(objects) != 1 else ''}, none "
            "applied (no cluster was asked; the image check runs at install)",
            file=sys.stderr,
        )
        return 0
    check_cluster(ns.context, local_option=False)
    load_config(ns.context)
    api = client.ApiClient()
    if ns.image_check:
        # Before anything is applied: runtimes whose images no node can pull would only show
        # it as TrainJobs stuck in ImagePullBackOff.
        checks = images.check(
            client.CoreV1Api(api),
            images.runtime_images(objects),
            backend_config(ns).namespace,
            timeout=ns.image_check_timeout,
        )
        for found in checks:
            print(found.line(), flush=True)
        failed = [c for c in checks if c.pullable is False]
        if failed:
            raise ImageNotPullable(images.failure_message(failed, source))
    for obj in objects:
        action = install(api, obj, delete_timeout=ns.delete_timeout)
        print(f"{describe(obj)} {action}", flush=True)
    return 0
