"""The scheduler's OpenAI-compatible HTTP front (FastAPI on uvicorn, on the scheduler's own event loop).

One concept per file: request_schemas.py and response_schemas.py (the JSON bodies, pydantic), convert.py (an OpenAI
request -> the same tandem.generate.v1 GenerateRequest the gRPC servicer takes), generation.py (a request's choices
running on the fleet, aborted when the client goes), render.py (deltas -> OpenAI responses and chunks), errors.py
(domain errors -> HTTP status + OpenAI error body), body_limit.py (413), cors.py (CORS), limits.py (the --http-*
limits), connections.py (read deadlines and connection caps, below the app), app.py (the routes), serve.py
(uvicorn)."""
