"""The typed client of the control plane's REST API, shared by the CLI and the dashboard."""
