"""The data plane's node side and its wire: block payloads between engines and a node over a
persistent binary stream and same-host shared memory, beside the REST control plane
(``docs/dataplane.md``).

``frames`` is the wire format (sans-IO, shared by both ends), ``transport`` the seam a carrier
implements (TCP and Unix-domain sockets here), ``server`` and ``samehost_server`` the node's
threaded servers over the operation layer (``sessioncache.operations``), and ``calls`` the
operation-layer calls their request frames name. The clients are in ``sessioncache.connector``
(``StreamClient``, ``SameHostClient``), which imports the wire from here and never a server.
Importing this package loads nothing.
"""
