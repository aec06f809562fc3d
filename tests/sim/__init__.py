"""A seeded simulation of the whole control plane, checked against invariants."""
