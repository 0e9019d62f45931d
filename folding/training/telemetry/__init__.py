"""Routing telemetry of a training run: per-step MoE statistics (expert load, drops, auxiliary
losses), the router-collapse watch, the routing trace file and the replica re-plan log."""
