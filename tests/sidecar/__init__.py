"""The sidecar daemon (`kvservice serve`), its client and its operations endpoints, in real
processes."""
