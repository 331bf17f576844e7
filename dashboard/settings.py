"""Settings of the dashboard deployable (environment prefix ``SPECGATE_DASHBOARD_``)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class DashboardSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECGATE_DASHBOARD_", extra="ignore")

    api_url: str = Field(default="http://127.0.0.1:8080", description="the control plane's base URL")
    api_key: str | None = Field(
        default=None,
        description="an API key (sgk_...) to sign in with; without it the user enters one in the sidebar")
    timeout_s: float = Field(default=15.0, gt=0, le=300, description="timeout of one API call")
    page_size: int = Field(default=50, ge=1, le=500, description="rows per page of growing lists")
    telemetry_limit: int = Field(default=10_000, ge=100, le=10_000,
                                 description="most rollup groups one chart asks the API for")
