"""The package layout; everything else about the project is in pyproject.toml.

The repository's top level is the design's layout: sdk_ext/, runtimes/, initializers/ and
trainers/ are one import package, ``tunepack``. pyproject.toml can map those
directories but cannot compute the package list over several roots, and a list kept by hand once
left ``tunepack.initializers.sources`` out of the wheel. Here every package below each root is
found, so a new subpackage ships without an edit (tests/integration/test_wheel.py checks the
built wheel).
"""

from setuptools import find_packages, setup

# import package -> the directory it lives in
ROOTS = {
    "tunepack": "sdk_ext",
    "tunepack.runtimes": "runtimes",
    "tunepack.initializers": "initializers",
    "tunepack.trainers": "trainers",
}

setup(
    package_dir=ROOTS,
    packages=[
        name
        for package, root in ROOTS.items()
        for name in (package, *(f"{package}.{sub}" for sub in find_packages(root)))
    ],
    # Read at run time: runtimes/store.py's load_runtime (the CLI, the local backend, install).
    # Only these: no other file of the source directories goes into the wheel.
    package_data={"tunepack.runtimes": ["generated/*.yaml"]},
    include_package_data=False,
)
