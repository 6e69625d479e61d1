"""The OpenAI-compatible HTTP server: `build_app(engine, ...)` and `serve_http(app, ...)`."""
