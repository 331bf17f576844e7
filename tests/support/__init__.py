"""Helpers the tests share. Test modules import these, never each other (checked by tests/test_layout.py)."""
