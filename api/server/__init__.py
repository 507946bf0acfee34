"""The process and its HTTP: the CLI, the starlette app and the one module that mounts the
protocols' routes (`api.server.app`), uvicorn with its bounds, the state the routes share,
keys, body limits, status counting, /metrics, /experts, /livez and placement planning."""
