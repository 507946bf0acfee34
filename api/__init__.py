"""HTTP in three packages: `api.server` (the process and its HTTP), `api.protocols` (one
package per wire: OpenAI's, Anthropic's, llama-server's tokenize) and `api.pipeline` (what
every protocol shares between its body and the scheduler's queue)."""
