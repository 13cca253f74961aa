"""The OpenAI-compatible HTTP front: FastAPI routes, request/response schemas, rendering, limits, errors."""
