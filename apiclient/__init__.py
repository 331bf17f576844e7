"""The typed client of the control plane's REST API, shared by the CLI and the dashboard.

``ApiClient(url, key).send(calls.policies())`` answers a :class:`Reply` with the
body as sent (``.json``) and typed (``.data``), or raises :class:`ApiError`
carrying the problem (status 0 when the control plane could not be reached).
"""

from apiclient import calls, models
from apiclient.calls import Call, Endpoint
from apiclient.client import DEFAULT_TIMEOUT_S, ApiClient, ApiError, Reply

__all__ = ["DEFAULT_TIMEOUT_S", "ApiClient", "ApiError", "Call", "Endpoint", "Reply", "calls", "models"]
