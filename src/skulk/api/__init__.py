"""HTTP API: one router per concern, all talking to the node through ApiServices."""
