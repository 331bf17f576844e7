"""Workers (sidecars): registration, heartbeats, staleness, and the fleet's overview."""
