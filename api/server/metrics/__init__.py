"""Prometheus metrics, the only package that imports prometheus_client: one collector per
thing measured (`requests`, `kv`, `steps`, `experts`, `process`), composed into the app's
`Metrics` (`registry`). Every series is prefixed `onegpu_`."""
