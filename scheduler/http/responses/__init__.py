"""OpenAI's Responses API on the HTTP front: its route, schemas, conversion, rendering and response store."""
