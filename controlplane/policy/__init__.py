"""Policies and their immutable, content-addressed revisions."""
