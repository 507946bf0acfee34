"""One package per wire, each its routes, wire types, input and codec around the shared
pipeline: `openai` (chat, completions, Responses), `anthropic` (Messages), `llama`
(llama-server's and vLLM's tokenize). No protocol imports another
(tests/test_layering.py); `api.protocols.openapi` documents them all."""
