"""HTTP: the starlette app, OpenAI routes, schemas, errors, /metrics and the CLI."""
