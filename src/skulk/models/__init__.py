"""Model catalogue (cards) and the locally generated demo model."""
