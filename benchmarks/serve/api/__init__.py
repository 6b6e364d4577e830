"""Requests through HTTP: the server's own path per request, generate and transduce latency, first requests, and
POST /v1/models."""
