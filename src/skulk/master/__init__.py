"""The master: the single writer that turns commands into ordered events."""
