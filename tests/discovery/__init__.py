"""Peer discovery: the static table and a real etcd (started by the tests), its outages and hostile
writers."""
