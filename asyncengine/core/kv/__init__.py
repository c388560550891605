"""KV-cache block accounting: the block pool, chained block hashes, the per-request manager."""
