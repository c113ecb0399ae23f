"""The worker: turns cluster state into runner processes on this node."""
