"""llama-server's (and vLLM's) token routes: /tokenize and /detokenize."""
