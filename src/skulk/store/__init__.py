"""Model files on disk and on the wire: Hugging Face downloads, the LAN store server and client, staging and
eviction of staged copies."""
