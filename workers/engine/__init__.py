"""The engine core: requests, schedulers, KV manager, outputs, and the KV connector."""
