"""The service as built: real NIXL agents in real processes over loopback, the CLI, the wheel, the
soak; bytes verified."""
