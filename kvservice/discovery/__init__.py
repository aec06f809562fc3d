"""Discovery: who is in the cluster, by name and role (``discovery = "etcd"``).

Static discovery (the default) is no code at all: engines pass ``host:port``.  With
etcd, each service registers itself on a lease and watches its peers
(``registry``); a peer whose lease lapses or whose incarnation changes is dropped
through the control plane's own peer-lost path.  etcd is never on the data path.
Only ``_etcd`` imports the etcd client (the optional extra ``kvservice[etcd]``).
"""

from .member import Member

__all__ = ["Member"]
