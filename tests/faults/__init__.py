"""Failures made to happen with real agents: SIGKILL, SIGSTOP, cancel, abort, network cuts, hostile
peers and frames."""
