"""The NIXL transport between P and D: the wire format, agents, handshakes, reads, streams.

Importing this package loads no NIXL: `agent` does, when it is imported itself. See README.md here."""
