"""Write runtimes/generated/: one ClusterTrainingRuntime per catalog entry, and a kustomization.

    python -m tunepack.runtimes.generate          # (re)write runtimes/generated/
    python -m tunepack.runtimes.generate --check  # exit 1 if the committed files are stale

The YAML is committed (``make runtimes``) so that ``kubectl apply -k`` needs no Python
(docs/architecture.md, "Runtimes")."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tunepack.runtimes.builder import generated_files
from tunepack.runtimes.store import GENERATED_DIR


def check(directory: Path | None = None) -> list[str]:
    """Problems with the files on disk: stale, missing or extra. Empty when up to date."""
    directory = directory or GENERATED_DIR
    expected = generated_files()
    present = {path.name for path in directory.glob("*.yaml")} if directory.is_dir() else set()
    problems = [f"missing: {name}" for name in sorted(set(expected) - present)]
    problems += [f"extra: {name}" for name in sorted(present - set(expected))]
    problems += [
        f"stale: {name}"
        for name in sorted(present & set(expected))
        if (directory / name).read_text(encoding="utf-8") != expected[name]
    ]
    return problems


def write(directory: Path | None = None) -> list[str]:
    """Write the generated files and remove extra ones; return the names written."""
    directory = directory or GENERATED_DIR
    directory.mkdir(parents=True, exist_ok=True)
    expected = generated_files()
    for path in directory.glob("*.yaml"):
        if path.name not in expected:
            path.unlink()  # a runtime removed from the catalog must leave the kustomization too
    for name, text in expected.items():
        (directory / name).write_text(text, encoding="utf-8")
    return list(expected)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tunepack.runtimes.generate", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if runtimes/generated/ is out of date"
    )
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        if problems:
            print("runtimes/generated/ is out of date; run `make generate`:", file=sys.stderr)
            for problem in problems:
                print(f"  {problem}", file=sys.stderr)
            return 1
        print("runtimes/generated/ is up to date")
        return 0
    for name in write():
        print(f"wrote runtimes/generated/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
