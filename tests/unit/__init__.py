"""Unit tests: pure Python, no process started and no socket listened on (tests/unit/conftest.py
refuses both), so ``pytest tests/unit`` is the quick loop while changing code."""
