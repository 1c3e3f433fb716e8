"""The pinned dependency set works together (see the comment on dependencies in pyproject.toml).

torchtune 0.6.1's training code imports torchao APIs that torchao 0.16 removed, and peft >= 0.19
refuses torchao < 0.16. These tests fail if an upgrade breaks either side; the adapter round trip
through peft is in test_trainer.py and test_cli.py.
"""

from __future__ import annotations

from importlib.metadata import version


def test_torchtune_training_imports_with_installed_torchao():
    from torchao.quantization import int4_weight_only  # noqa: F401  (gone in torchao 0.16)
    from torchtune.training.quantization import Int4WeightOnlyQuantizer  # noqa: F401

    assert version("torchtune") == "0.6.1"


def test_peft_accepts_installed_torchao():
    from peft.import_utils import is_torchao_available

    # peft raises ImportError here when it considers torchao too old.
    assert is_torchao_available() is True
    assert version("peft").startswith("0.18.")
