"""What every protocol shares: the internal generation request, and the one way it becomes
queued work (`api.pipeline.prepare`) and comes back as output blocks, streamed or whole.
No module here imports a protocol (tests/test_layering.py)."""
