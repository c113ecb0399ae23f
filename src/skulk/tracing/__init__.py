"""Runtime tracing: spans of traced tasks saved per node, read locally or across the cluster (runbook 004)."""
