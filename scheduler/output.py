"""Token ids to text, outside the scheduler lock: detokenization and stop strings.

The scheduler core decides what runs and when a request ends by its tokens (an
end-of-generation token, `max_tokens`); what the tokens *say* is decided here, in the
engine thread after the step's postprocess and without the lock the event loop needs to
add and abort requests (vLLM's OutputProcessor, nano-vllm's engine loop). A stop string
found here ends the request: its output is cut before the string, and the scheduler is
told to stop it (`Scheduler.stop`), which it does before its next step — so the request
costs no more steps than when the core matched stop strings itself.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.detok import IncrementalDetokenizer
from scheduler.request import Request, RequestOutput
from scheduler.stops import StopMatcher


@dataclass(slots=True)
class _Text:
    detok: IncrementalDetokenizer
    stops: StopMatcher


class OutputProcessor:
    """Per request, the text of its tokens so far; one per engine loop (all lanes)."""

    def __init__(self) -> None:
        self._texts: dict[str, _Text] = {}

    def add(self, req: Request) -> None:
        self._texts[req.req_id] = _Text(req.detok, req.stops)

    def drop(self, req_id: str) -> None:
        """The request left (aborted, its stream closed)."""
        self._texts.pop(req_id, None)

    def process(self, outputs: list[RequestOutput]) -> tuple[list[RequestOutput], list[str]]:
        """The outputs with their text; and the requests a stop string ended — the core
        then stops those it has not ended, and counts the others as stopped, not as cut
        at max_tokens. Outputs of a request already ended are dropped."""
        done: list[RequestOutput] = []
        stopped: list[str] = []
        for o in outputs:
            t = self._texts.get(o.req_id)
            if t is None:
                continue  # ended by a stop string in an earlier output
            text, hit = "", False
            # the core ends with "stop" only on an end-of-generation token: not text
            if o.token_ids and o.finish_reason != "stop":
                for tok_text in map(t.detok.add, o.token_ids):
                    piece, hit = t.stops.feed(tok_text)
                    text += piece
                    if hit:
                        break
            end = o.finish_reason is not None or hit
            if end and not hit:
                tail, hit = t.stops.feed(t.detok.flush())
                text += tail if hit else tail + t.stops.flush()
            reason = "stop" if hit else o.finish_reason
            if hit:
                stopped.append(o.req_id)
            if end:
                self._texts.pop(o.req_id, None)
            stop_string = t.stops.hit if hit else None
            done.append(replace(o, text=text, finish_reason=reason, stop_string=stop_string))
        return done, stopped
