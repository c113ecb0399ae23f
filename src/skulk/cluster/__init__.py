"""Control plane: zenoh transport, membership, election and ordered event sync."""
