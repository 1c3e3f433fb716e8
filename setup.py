"""The package layout; everything else about the project is in pyproject.toml.

The repository's top level is the design's layout: sdk_ext/, runtimes/, initializers/ and
trainers/ are one import package, ``tunepack``. pyproject.toml can map those
directories but cannot compute the package list over several roots, and a list kept by hand once
left ``tunepack.initializers.sources`` out of the wheel. Here every package below each root is
found, so a new subpackage ships without an edit (tests/integration/test_wheel.py checks the
built wheel).
"""

import warnings

from setuptools import find_packages, setup
from setuptools.warnings import InformationOnly

# A strict editable install (the Makefile's editable_mode=strict) has setuptools tell, on every
# build, that it laid its link tree out in build/__editable__.* and not to remove it: a notice
# with nothing to act on (the Makefile says what the tree is), which pip prints as a 13-line
# warning at each `make install` and `make dev`. That notice alone is left out; setuptools' other
# warnings, and its deprecations, are shown as before.
warnings.filterwarnings("ignore", message=r"Editable installation\.", category=InformationOnly)

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
