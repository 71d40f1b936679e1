"""The HTTP runtime: ``Server`` (ASGI app over an Engine), protocol structs, metrics."""
