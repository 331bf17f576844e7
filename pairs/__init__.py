"""Checks that a target model and its draft model can work together, read from their local directories.

A small library with no network, web or database code (an import contract says so): the ``specgate
check-pair`` command, the sidecar that starts a draft engine, and the testbed's set-up all call it.
"""

from pairs.tokenizers import (
    PairReport,
    TokenizerFacts,
    TokenizerUnreadable,
    check_pair,
    compare,
    read_tokenizer,
)

__all__ = ["PairReport", "TokenizerFacts", "TokenizerUnreadable", "check_pair", "compare", "read_tokenizer"]
