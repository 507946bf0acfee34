"""Continuous batching: a pure, synchronous core (`core`) and a thin asyncio shell (`loop`)."""
