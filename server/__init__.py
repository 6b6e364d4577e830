"""The HTTP inference server: settings, protocol (pydantic only), engine (no HTTP), app factory.

Importing this package imports nothing else, so that the client can use ``server.api.protocol`` without torch.
"""
