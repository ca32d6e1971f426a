"""Helpers shared by the tests (importable as ``helpers``: ``tests/`` is on pytest's path)."""
