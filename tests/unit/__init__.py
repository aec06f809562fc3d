"""Unit tests: the state machine, protocol, layout and configuration, without NIXL or child
processes (scripted fakes only here)."""
