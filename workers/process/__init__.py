"""Process shells: the worker host, its request channel, KV control, Ray and RPC actors."""
