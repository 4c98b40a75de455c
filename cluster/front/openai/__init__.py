"""The OpenAI-compatible HTTP front door: ``server.OpenAIServer`` (aiohttp), ``api`` (request and
response shapes, pure) and ``chat_template``. Nothing is imported here, so that the pure ``api``
module can be imported without aiohttp."""
