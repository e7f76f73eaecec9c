"""The wire: what farm's processes say to each other and how.

``protocol`` frames and checks messages, ``messages`` defines their typed headers,
``link`` keeps a peer's connection to the broker (heartbeats, back-off, CURVE handshake
monitor), ``curve`` makes CurveZMQ key folders and sockets, ``wakeup`` stops a socket loop
on a signal, and ``shapes`` and ``storage`` describe a job's items (dtypes, chunk limits,
files on shared storage) as the messages carry them.
"""
