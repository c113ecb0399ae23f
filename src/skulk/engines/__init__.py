"""Engines run prefill and decode for one shard. Runners drive them; nothing here knows about the cluster."""
