"""Anthropic's wire: /v1/messages and /v1/messages/count_tokens."""
