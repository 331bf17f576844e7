"""The REST commands of ``specgate``: policies, rollouts, the fleet, analysis and recommendations."""
