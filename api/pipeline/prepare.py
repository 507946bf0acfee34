"""The one way a generation request becomes queued work, whatever API it came by.

Stages, in the order their refusals reach a client (modules of api.pipeline):
  1. check     stop strings bounded, the lane resolved              (validation, lanes)
  2. admit     room in the queue held, or 400 / 429                  (submission)
  3. constrain tools and output format into one grammar              (structured)
  4. tokenize  render the chat or take the prompts, off the loop     (prompts)
  5. sequence  limits, sampling and lane rules per prompt and choice (sequences)
  6. submit    every sequence queued, or none                        (submission)
A route decodes its body into the `GenerationRequest` before stage 1 and encodes the
`Generation` it gets back after stage 6; nothing here knows which API asked. The
tokenize-only path (token counting) is the lane, the tools and stage 4: nothing is held,
compiled or queued.
"""

from __future__ import annotations

from api.pipeline.generation import Generation
from api.pipeline.lanes import resolve_lane
from api.pipeline.prompts import Prompt, tokenize
from api.pipeline.request import GenerationRequest
from api.pipeline.sequences import sequences
from api.pipeline.structured import constrain, request_tools
from api.pipeline.submission import admission, submit
from api.pipeline.validation import check_stops
from api.server.state import ServerState


async def prepare(state: ServerState, req: GenerationRequest, client: str) -> Generation:
    """Validate, render, tokenize and queue `req` for `client`; its generation."""
    check_stops(req.stop)
    lane = resolve_lane(req.lane, state.settings.lanes)
    with admission(state, lane, client, req.sequences, "prompt" if req.sequences > req.n else "n"):
        tools = request_tools(state, req)
        constraint = await constrain(state, req.response_format, tools)
        prompts = await tokenize(state, req, tools, state.max_len(lane))
        seqs = sequences(state, req, prompts, constraint, lane, client)
        queues = submit(state, lane, seqs)
    return Generation(state, req, lane, prompts, tools, [s.req_id for s in seqs], queues)


async def count_tokens(state: ServerState, req: GenerationRequest) -> list[Prompt]:
    """`req`'s prompts as the model would read them, queued nowhere (token counting)."""
    lane = resolve_lane(req.lane, state.settings.lanes)
    return await tokenize(state, req, request_tools(state, req), state.max_len(lane))
