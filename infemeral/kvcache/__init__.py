"""KV caches: the client's contiguous one, the server's page pool, the sliding window, and the encrypted form
a session is stored in."""
