"""The engine testbed: real vLLM (CPU build) with tiny models trained here, for end-to-end tests and demos.

Python API (what tests and ``make run`` use)::

    from testbed import ensure, start, stop
    tb = ensure()                        # engine venv + trained models, built once, cached
    urls = start(["base", "ngram"])      # {"base": "http://127.0.0.1:8100", "ngram": "http://127.0.0.1:8101"}
    ...                                  # POST {url}/v1/chat/completions with model=MODEL_NAME
    stop()                               # only the engines this testbed recorded

The cache lives in ``$SPECGATE_CACHE_DIR`` (default ``$XDG_CACHE_HOME/specgate``
or ``~/.cache/specgate``); engine state and logs in ``$SPECGATE_TESTBED_STATE``
(default ``.specgate/testbed`` in the checkout).
"""

from __future__ import annotations

from testbed.engines import DEFAULT_BASE_PORT, MODEL_NAME, VARIANTS, start, status, stop
from testbed.models import ModelPaths, Testbed, ensure, ensure_models

__all__ = ["DEFAULT_BASE_PORT", "MODEL_NAME", "VARIANTS", "ModelPaths", "Testbed", "ensure", "ensure_models",
           "start", "status", "stop"]
