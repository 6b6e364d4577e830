"""Python client and command line of the regularlm server; they import only ``server.api.protocol``."""

from clients.client import APIStatusError, AsyncClient, Client, RetryPolicy

__all__ = ["APIStatusError", "AsyncClient", "Client", "RetryPolicy"]
