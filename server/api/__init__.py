"""The HTTP API: routes, request and response bodies, limits, and the OpenAPI schema."""
