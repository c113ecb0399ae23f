"""Runner processes: one per shard, spawned and supervised by the worker."""
