"""The audit log: every change to policies, rollouts, keys and the kill switch, with who, why, before and after."""
