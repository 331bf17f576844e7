"""The pure analysis library: histograms, batch buckets, rollups, statistics, cells, recommendations, guardrails.

Imports no web framework, no database and no network code (checked by the
import contracts in ``pyproject.toml``): the control plane feeds it from its
rollups, ``specgate recommend offline`` and the testbed from files.
"""
