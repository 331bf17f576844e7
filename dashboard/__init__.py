"""specgate dashboard: Streamlit over the control plane's REST API (docs/dashboard.md)."""
