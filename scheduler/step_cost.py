"""What a step costs: a model learned from the steps the engine ran.

A step of D decode tokens (attending `decode_cells` KV cells between them) and prompt
chunks of n tokens starting at KV depth d takes

    t = a + b * D + e * decode_cells                       (the decode part)
      + sum over chunks of  c0 * n + c1 * n * (d + n / 2) + g * (d + n)
      + h * physical_batches

Attention makes a prompt token dearer the more context it attends to (c1); a chunk also
makes whole passes over the KV it attends, whatever its size, since kernels work in tiles
(g); and each physical batch of `ubatch` rows (llama.cpp runs a step as such batches) pays
a fixed cost — with the experts in host RAM, their copy to the GPU (an H200 step of 4
decoders took 84 ms alone, 185 ms with 32 prompt rows, 193 ms with 283). The decode part is
fitted on decode-only steps, the prompt part on what steps with prompts took beyond it,
both by `NonNegativeFit`, so the model follows the machine as it warms up or gets busy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.fit import NonNegativeFit


@dataclass(slots=True)
class StepDraft:
    """A step as the cost model and the chunk policy see it, built while it is planned."""

    n_decode: int = 0
    decode_cells: int = 0  # KV cells its decode tokens attend, summed
    waiting: bool = False  # someone's next token waits for it (decoders, or another lane)
    exempt: bool = False  # a burst's step: its prompts arrived with its decoders
    chunks: list[tuple[int, int]] = field(default_factory=list)  # prompt (tokens, depth)
    finishing: int = 0  # of its chunks, those that end a prompt (a first token at its end)
    ending: int = 0  # of those, the prompts whose streams end with that first token
    ahead: float = 1.0  # tokens its streams still have to come, a mean (at least 1)
    last: int = 0  # steps until its decoders have all finished, at most (their max_tokens)

    def add(self, n: int, depth: int, ends: bool, tokens: int) -> None:
        """A prompt chunk of `n` tokens from `depth` joins; where it `ends` its prompt,
        its stream's `tokens` to come count in `ahead` (a step of prompts alone has no
        decoders to tell how long its streams will run)."""
        self.chunks.append((n, depth))
        if ends:
            k = self.n_decode + self.finishing
            self.ahead = (self.ahead * k + max(1, tokens)) / (k + 1)
            self.finishing += 1
            self.ending += tokens <= 1

    @property
    def rows(self) -> int:
        return self.n_decode + sum(n for n, _ in self.chunks)


class StepCostModel:
    """The learned step-time model of the module doc."""

    # A step may be at most twice the largest the prompt fit learned from recently (it
    # loses 3% a step), and may not cross a kernel boundary (`trusted_rows`): beyond
    # that the fit extrapolates, and a fit taught by short chat prompts (a fixed cost,
    # nothing per token) granted 6 s steps at a 1 s target.
    SEEN_DECAY = 0.97

    def __init__(self, ubatch: int = 0, tile: int = 0) -> None:
        if tile & (tile - 1) or (tile and ubatch % tile):
            raise ValueError("the attention tile must be a power of two dividing ubatch")
        self.ubatch = ubatch  # llama.cpp's physical batch (0: not known)
        self.tile = tile  # query rows per CPU attention tile (0: attention is not tiled)
        self._decode = NonNegativeFit(3)  # x = (1, D, decode cells)
        # x = (tokens, token-cells, token-cells in tiles, KV span, physical batches)
        # Chunks all of one size cannot tell a cost per token from one per batch: the fit
        # then takes the batch's, so chunks grow (within the extrapolation cap) and show it.
        # Taken as per token, chunks stayed at the minimum: nothing ever told it otherwise.
        self._prompt = NonNegativeFit(5, first=(4,))
        self.largest_rows = 0  # of recent steps with prompts (decaying)
        self.smallest_rows = 0  # ... and the smallest (rising back by the same rate)
        self._pays: bool | None = None

    @property
    def knows_prompts(self) -> bool:
        return self._prompt.ready

    def batches(self, rows: int) -> int:
        return -(-rows // self.ubatch) if self.ubatch else 1

    def decode_time(self, n_decode: int, decode_cells: int = 0) -> float:
        return self._decode.predict((1.0, float(n_decode), float(decode_cells)))

    def _prompt_x(self, step: StepDraft) -> tuple[float, float, float, float, float]:
        """The prompt part's terms. From `tile` rows on, ggml's CPU flash attention runs in
        tiles of that many query rows: a dearer kernel, paid for whole tiles (a 65-row step
        costs what 128 rows do: the padding is geometry, known before any step is measured)
        — a term of its own on top of the untiled one, so that a tiled step not yet
        measured is planned as an untiled one of its padded size, not as free."""
        rows = step.rows
        cells = sum(n * (d + n / 2) for n, d in step.chunks)
        tiled = bool(self.tile) and rows >= self.tile
        pad = -(-rows // self.tile) * self.tile / rows if tiled else 1.0
        return (
            float(sum(n for n, _ in step.chunks)), cells * pad, cells * pad if tiled else 0.0,
            float(sum(d + n for n, d in step.chunks)), float(self.batches(rows)),
        )  # fmt: skip

    def prompt_time(self, step: StepDraft) -> float:
        return self._prompt.predict(self._prompt_x(step)) if step.chunks else 0.0

    def step_time(self, step: StepDraft) -> float:
        return self.decode_time(step.n_decode, step.decode_cells) + self.prompt_time(step)

    def delay(self, step: StepDraft, n: int, depth: int) -> float:
        """What an n-token chunk from `depth` adds to `step`: everyone in it waits that."""
        with_it = StepDraft(step.n_decode, step.decode_cells, chunks=[*step.chunks, (n, depth)])
        return self.prompt_time(with_it) - self.prompt_time(step)

    def chunk_time(self, n: int, depth: int) -> float:
        """A chunk's time alone in a step (to weigh recomputing a prompt)."""
        return self.prompt_time(StepDraft(chunks=[(n, depth)]))

    def joins(self, step: StepDraft, n: int, depth: int, behind: int) -> bool:
        """Should a prompt chunk join a step that already ends other prompts? By the time
        users wait. Joined, the step takes the chunk's marginal time in it (`delay`): each
        finishing prompt's first token comes that much later. Left out, the chunk runs in
        a later step beside those prompts' streams, which then pause as long for it — only
        a prompt whose stream ends with its first token is spared — while the chunk and
        the `behind` prompts queued after it wait one more step's base time (the
        decoders' step, or a bare step's fixed cost), and the chunk costs its time in a
        step of its own (`alone`) instead of `delay`: machine time that every stream then
        waits in each token it still has to come (`ahead`). So a wave's prompts share one
        step, as llama-server batches every waiting prompt, unless the larger step costs
        more than its parts (a row that opens another attention tile or physical batch):
        then the chunk waits. Counting a left-out prompt's time as saved for the prompts
        in the step (their first tokens sooner) spread each wave of 16 chat users on the
        CPU over four steps beside its own first streams, and paused them ~1 s at p99
        against llama-server's 0.15-0.2 s."""
        if not step.finishing or not (self.knows_prompts and self._decode.ready):
            return True  # (nothing known yet of what a step costs: they share it)
        if 2 * self.smallest_rows > self.largest_rows:
            # steps with prompts all of about one size cannot tell a row's cost in a small
            # step from one in a large: as llama-server, they share it (a wave of prompts
            # in one step, then another, taught a 2-core CPU no batching economy and it
            # spread the next wave one prompt a step, at 0.9x the decode rate)
            return True
        delay = self.delay(step, n, depth)
        alone = self.prompt_time(StepDraft(step.n_decode, step.decode_cells, chunks=[(n, depth)]))
        base = self.decode_time(step.n_decode, step.decode_cells)
        streams = step.n_decode + step.finishing + 1
        saved = streams * step.ahead * (alone - delay)
        return (1 + behind) * base + saved >= step.ending * delay

    def waits_for_decoders(self, step: StepDraft, rest: int, depth: int, behind: int) -> bool:
        """Should a new prompt of `rest` tokens wait until the step's decoders have
        finished, instead of starting beside them? By the users' whole wait: beside them,
        each decoder waits for the prompt's work (its marginal time in their steps); held
        back, the prompt and the `behind` prompts queued after it wait up to `last`
        decoder steps. Closed-loop users whose waves came apart (a wave's prompts arriving
        over a second, its later ones chunked beside its first ones' decoding) stay apart
        for good: each new prompt then lands on every other user's stream, and 16 chat
        users on the CPU paused 4.9x as long as llama-server's at p99 (741 ms, a 128-token
        prompt beside 15 decoders, against its decode steps of 152). A prompt that comes a
        few steps before the others' streams end waits for them, and the wave is whole
        again; one that would wait for long streams joins them. (For a prompt that fits
        one step: a long one's work is the stall target's, chunk by chunk, and the sum
        would hold a 20K prompt back for the whole of 4 long streams.)"""
        if not step.n_decode or step.exempt or not (self.knows_prompts and self._decode.ready):
            return False
        wait = step.last * self.decode_time(step.n_decode, step.decode_cells)
        return (1 + behind) * wait < step.n_decode * self.delay(step, rest, depth)

    def trusted_rows(self) -> int:
        """The largest step with prompts the model may plan: twice the largest it learned
        from recently, but no further than the next boundary where kernels change (a full
        attention tile, a full physical batch): a step past it runs another kernel, or
        pays another batch's fixed cost, that the fit has not seen lately (a 2-tile CPU
        step, planned from a fit of sub-tile steps, ran 2.6x its plan)."""
        seen = max(self.largest_rows, 1)
        cap = 2 * seen
        if self.tile > seen:
            cap = min(cap, self.tile)
        if self.ubatch:
            cap = min(cap, (seen // self.ubatch + 1) * self.ubatch)
        return cap

    def batching_pays(self) -> bool:
        """Does decoding one more sequence in a step cost less than half of decoding it
        alone (its own work — per token and per KV cell it attends, at the depth steps have
        had — below the per-step work)? Then two together run 1.33x+ the tokens of two one
        after the other. On a GPU it always does; on a few CPU cores a small model's decode
        is compute-bound and it does not. True until steps of different sizes were seen."""
        return self._pays is None or self._pays

    def _judge_batching(self) -> None:
        """Judged only while steps of different sizes carry 10% or more of what the fit
        remembers (variance of D >= 0.1): below that the slope rests on a few old steps,
        and whatever changed since reads as the cost of a second sequence. Depth is in the
        fit because the steps it compares come at different depths (deep single steps
        looked as dear as shallow double ones without it)."""
        f = self._decode
        n, sd, sk, sdd = f.xx[0][0], f.xx[0][1], f.xx[0][2], f.xx[1][1]
        if n > 0 and sdd / n - (sd / n) ** 2 >= 0.1:
            a, b, e = f.fit()
            self._pays = b + e * sk / sd <= a

    def observe(self, step: StepDraft, seconds: float) -> None:
        if not step.chunks:
            if step.n_decode:
                self._decode.add((1.0, float(step.n_decode), float(step.decode_cells)), seconds)
                self._judge_batching()
            return
        self.largest_rows = max(step.rows, int(self.largest_rows * self.SEEN_DECAY))
        rising = self.smallest_rows / self.SEEN_DECAY + 1
        self.smallest_rows = min(step.rows, int(rising)) if self.smallest_rows else step.rows
        rest = max(seconds - self.decode_time(step.n_decode, step.decode_cells), 0.0)
        self._prompt.add(self._prompt_x(step), rest)

    def terms(self) -> dict[str, float]:
        """The model's current figures (for /metrics)."""
        out: dict[str, float] = {}
        if self._decode.ready:
            a, b, e = self._decode.fit()
            out |= {"decode_step_s": a, "decode_token_s": b, "decode_kv_cell_s": e}
        if self.knows_prompts:
            c0, c1, c1t, g, h = self._prompt.fit()
            out |= {"prompt_token_s": c0, "prompt_token_per_kv_cell_s": c1,
                    "prompt_token_per_kv_cell_tiled_s": c1t, "prompt_chunk_per_kv_cell_s": g,
                    "prompt_batch_s": h}  # fmt: skip
        return out
