"""Load a GGUF model and its one llama.cpp context; own both native handles.

Also the model-side facts the rest of the server needs: tokenizer, token pieces for
incremental detokenization, end-of-generation tokens, the GGUF's chat template.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from pathlib import Path
from typing import Any

from engine import moe_cache, weight_buffers
from engine._capi import llama, llama_log_lines
from engine.config import EngineConfig
from engine.context import LLAMA_MAX_SEQ, Context
from engine.errors import ModelLoadCancelled, ModelLoadError
from engine.expert_tap import ExpertTap
from engine.grammar import Grammars
from engine.load_progress import LoadProgress
from engine.pick_store import PickStore, top_experts
from engine.placement import CpuOverrides

log = logging.getLogger(__name__)

CPU_ATTENTION_TILE = 64  # query rows per tile of ggml's CPU flash attention (GGML_FA_TILE_Q)
KV_PAD_CELLS = 256  # llama.cpp pads each sequence's KV stream to a multiple of this


class Model:
    """A loaded model plus its contexts (`main`: the shared lane). `close()` frees all.
    `progress` follows the load and can cancel it (`ModelLoadCancelled`)."""

    def __init__(self, cfg: EngineConfig, progress: LoadProgress | None = None) -> None:
        ll = llama()
        self.ll = ll
        self.cfg = cfg
        path = Path(cfg.model_path)
        if not path.is_file():
            raise ModelLoadError(f"model file not found: {path}")
        mparams = ll.llama_model_default_params()
        mparams.n_gpu_layers = cfg.n_gpu_layers
        if cfg.use_mmap is False:  # a plain read (llama.cpp's --load-mode none)
            mparams.load_mode = ll.LLAMA_LOAD_MODE_NONE
        if cfg.expert_cache_slots > 0:
            # Tensors kept in host RAM in plain buffers, never repacked for the CPU's kernels
            # (llama.cpp repacks Q4_0 and others on AVX2 hosts, even mapped): the cache's
            # bank takes byte copies of GGUF expert slices, and a repacked tensor is not one.
            mparams.use_extra_bufts = False
        overrides = CpuOverrides(ll, list(cfg.cpu_tensors)) if cfg.cpu_tensors else None
        if overrides is not None:
            mparams.tensor_buft_overrides = overrides.pointer
        if progress is not None:
            mparams.progress_callback = progress.callback(ll)
        with llama_log_lines() as lines:
            self.model = ll.llama_model_load_from_file(str(path).encode(), mparams)
        del overrides  # llama.cpp read the patterns during the load
        if not self.model:
            if progress is not None and progress.cancelled:
                raise ModelLoadCancelled(
                    f"load of {path} cancelled at {100 * progress.fraction:.0f}%"
                )
            raise ModelLoadError(f"llama.cpp could not load {path}")
        self.weight_buffers = weight_buffers.parse(lines)
        log.info("weights by buffer: %s", self.weight_buffers.describe())
        warning = weight_buffers.unpinned_warning(
            self.weight_buffers, gpu=self._gpu_offload(), read=cfg.use_mmap is False
        )
        if warning:
            log.warning("%s", warning)
        self.vocab = ll.llama_model_get_vocab(self.model)
        self.n_vocab: int = ll.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train: int = ll.llama_model_n_ctx_train(self.model)

        self.arch = self.meta_str("general.architecture") or ""
        self.n_layer: int = ll.llama_model_n_layer(self.model)
        self.n_expert = int(self.meta_str(f"{self.arch}.expert_count") or 0)
        self.n_expert_used = int(self.meta_str(f"{self.arch}.expert_used_count") or 0)
        self.n_swa: int = ll.llama_model_n_swa(self.model)  # sliding attention window, or 0
        # llama.cpp bounds sequence ids (the running and the cache's holders) by 256
        self.n_cached_seqs = max(0, min(cfg.n_cached_seqs, LLAMA_MAX_SEQ - cfg.n_seq_max))
        if self.n_cached_seqs < cfg.n_cached_seqs:
            log.warning("prefix cache: %d holder ids (at most %d sequence ids in all)",
                        self.n_cached_seqs, LLAMA_MAX_SEQ)  # fmt: skip

        self.contexts: list[Context] = []
        try:
            self.tap = self._expert_tap()
            self.main = self.open_context(
                n_ctx=cfg.n_ctx, n_seq_max=cfg.n_seq_max + self.n_cached_seqs,
                unified=True,  # admission by tokens
                device_greedy=self._device_greedy(), tap=self.tap,
                swa_full=self.swa_full,
            )  # fmt: skip
            self.expert_cache_layers = self._expert_cache()
        except ModelLoadError:
            for c in self.contexts:
                c.close()
            ll.llama_model_free(self.model)
            raise
        self.n_ctx: int = self.main.n_ctx
        self.n_batch: int = self.main.n_batch
        self.n_seq_max: int = cfg.n_seq_max
        self.add_bos: bool = bool(ll.llama_vocab_get_add_bos(self.vocab))
        self._pieces: list[bytes | None] = [None] * self.n_vocab
        self._piece_buf = ctypes.create_string_buffer(256)
        log.info(
            "loaded %s: n_vocab=%d n_ctx_train=%d n_ctx=%d n_batch=%d n_seq_max=%d threads=%d/%d",
            path.name, self.n_vocab, self.n_ctx_train, self.n_ctx, self.n_batch,
            self.n_seq_max, *cfg.threads(),
        )  # fmt: skip

    # ---- tokenizer -------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        """Text to token ids; thread-safe (reads the vocabulary only)."""
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (self.ll.llama_token * cap)()
        n = self.ll.llama_tokenize(
            self.vocab, data, len(data), buf, cap, add_special, parse_special
        )
        if n < 0:
            cap = -n
            buf = (self.ll.llama_token * cap)()
            n = self.ll.llama_tokenize(
                self.vocab, data, len(data), buf, cap, add_special, parse_special
            )
        return list(buf[:n])

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token renders to (special tokens render empty); cached per token."""
        piece = self._pieces[token]
        if piece is None:
            piece = self._render(token, special=False)
            self._pieces[token] = piece
        return piece

    def token_text(self, token: int) -> bytes:
        """The token as logprobs show it: special tokens by their name."""
        return self._render(token, special=True)

    def _render(self, token: int, *, special: bool) -> bytes:
        buf = self._piece_buf
        n = self.ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self.ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def longest_token_bytes(self) -> int:
        """Bytes of the vocabulary's longest token (special tokens by name): a text of B
        bytes is at least B / this many tokens, which bounds a prompt before tokenizing."""
        return max(len(self.token_text(t)) for t in range(self.n_vocab))

    def is_eog(self, token: int) -> bool:
        return bool(self.ll.llama_vocab_is_eog(self.vocab, token))

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Grammar compilation over this vocabulary (constrained output); a grammar ends
        on any end-of-generation token."""
        vocab = ctypes.cast(self.vocab, ctypes.c_void_p).value or 0
        tokenize = ctypes.cast(self.ll._lib.llama_tokenize, ctypes.c_void_p).value or 0
        return Grammars(vocab, tokenize, self._grammar_pieces, lambda: self.eog_ids)

    @functools.cached_property
    def eog_ids(self) -> list[int]:
        """Every end-of-generation token (EOS, EOT, <end_of_turn> …)."""
        return [t for t in range(self.n_vocab) if self.is_eog(t)]

    def _grammar_pieces(self) -> list[bytes]:
        """Every token's bytes as llguidance reads them: special tokens (CONTROL, and
        USER_DEFINED ones written like `<tag>`) by name behind a 0xFF byte, so a grammar
        can name them and text never matches them."""
        out = []
        for t in range(self.n_vocab):
            piece = self._render(t, special=True)
            out.append(b"\xff" + piece if self.grammar_special(t, piece) else piece)
        return out

    def grammar_special(self, token: int, piece: bytes | None = None) -> bool:
        """Whether grammars see `token` as a special token (named `<[id]>`, never matched
        by text): CONTROL tokens, and USER_DEFINED ones written like a tag."""
        ll = self.ll
        attr = ll.llama_vocab_get_attr(self.vocab, token)
        if attr & ll.LLAMA_TOKEN_ATTR_CONTROL:
            return True
        piece = self._render(token, special=True) if piece is None else piece
        return (
            bool(attr & ll.LLAMA_TOKEN_ATTR_USER_DEFINED)
            and piece[:1] == b"<"
            and piece[-1:] == b">"
        )

    def is_control(self, token: int) -> bool:
        """Whether llama.cpp matches this token by its text only when `parse_special` is set
        (CONTROL or UNKNOWN attribute): the tokens message content must never spell.
        USER_DEFINED tokens are not: llama.cpp matches them in any text (Gemma's are newlines,
        runs of spaces, HTML tags), so content that produces them is ordinary text."""
        attr = self.ll.llama_vocab_get_attr(self.vocab, token)
        return bool(attr & (self.ll.LLAMA_TOKEN_ATTR_CONTROL | self.ll.LLAMA_TOKEN_ATTR_UNKNOWN))

    def special_text(self, token: int) -> str:
        """Text of a special token (BOS/EOS) for chat templates; '' when the model has none."""
        if token < 0:
            return ""
        return self.token_text(token).decode("utf-8", "replace")

    @property
    def bos_token(self) -> str:
        return self.special_text(self.ll.llama_vocab_bos(self.vocab))

    @property
    def eos_token(self) -> str:
        return self.special_text(self.ll.llama_vocab_eos(self.vocab))

    def chat_template(self) -> str | None:
        """The GGUF's `tokenizer.chat_template`, if it carries one."""
        ptr = self.ll.llama_model_chat_template(self.model, None)
        return ptr.decode("utf-8") if ptr else None

    def meta_str(self, key: str) -> str | None:
        """A GGUF metadata value as llama.cpp renders it; None when the key is absent."""
        buf = ctypes.create_string_buffer(256)
        n = self.ll.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return None if n < 0 else buf.value.decode("utf-8", "replace")

    # ---- contexts ---------------------------------------------------------------------
    def _expert_tap(self) -> ExpertTap | None:
        rate = self.cfg.expert_sample_rate
        if rate <= 0 or self.n_expert == 0:
            return None
        return ExpertTap(
            self.ll, n_layer=self.n_layer, n_expert=self.n_expert, n_ubatch=self.cfg.n_ubatch,
            rate=rate,
        )  # fmt: skip

    def _expert_cache(self) -> int:
        """Configure the shared lane's routed-expert cache; the layers it covers."""
        cfg = self.cfg
        if cfg.expert_cache_slots <= 0 or self.n_expert == 0:
            return 0
        gpu = cfg.n_gpu_layers != 0 and bool(self.ll.llama_supports_gpu_offload())
        uploads = moe_cache.upload_cap(cfg.expert_cache_uploads, self.n_expert_used)
        try:
            n = moe_cache.configure(
                self.main.ctx, cfg.expert_cache_slots, max_uploads=uploads,
                max_tokens=cfg.n_seq_max, device=None if gpu else "CPU",
            )  # fmt: skip
            if n > 0:
                moe_cache.set_admission(self.main.ctx, cfg.expert_cache_admission)
                if cfg.expert_cache_misses == "gpu":
                    on = moe_cache.set_misses(self.main.ctx, cfg.n_seq_max)
                    log.info("routed-expert cache: misses of %d of %d layers on the GPU", on, n)
                self._fill_expert_cache(cfg.expert_cache_slots)
        except moe_cache.ExpertCacheError as e:
            raise ModelLoadError(f"routed-expert cache: {e}") from e
        if n == 0:
            log.info("routed-expert cache: no layer has its experts in plain host RAM; off")
        return n

    def _fill_expert_cache(self, slots: int) -> None:
        """Upload each cached layer's most picked experts (cfg.expert_cache_fill) now, so
        that the first requests find a warm bank rather than paying for the fill (an upload
        a miss, on the decode thread) — evictable as any other slot."""
        path = self.cfg.expert_cache_fill
        if path is None:
            return
        prior = PickStore(Path(path), self.n_layer, self.n_expert).prior
        if prior is None:
            return
        t0, n = time.perf_counter(), 0
        for layer in range(self.n_layer):
            for expert in top_experts(prior, layer, slots):
                try:
                    moe_cache.preload(self.main.ctx, layer, expert)
                except moe_cache.ExpertCacheError:
                    break  # a layer the cache does not cover
                n += 1
        log.info("routed-expert cache: %d experts uploaded from %s in %.1f s", n, path,
                 time.perf_counter() - t0)  # fmt: skip

    def step_geometry(self) -> tuple[int, int]:
        """(physical batch, attention tile): where a step's cost jumps. llama.cpp runs a
        step as physical batches of n_ubatch rows; where attention runs on the CPU, ggml's
        flash attention works in tiles of CPU_ATTENTION_TILE query rows from that many on
        (0: not tiled, or a physical batch the tile does not divide)."""
        ubatch = min(self.cfg.n_ubatch, self.n_batch)
        tile = CPU_ATTENTION_TILE if self.attention_on_cpu else 0
        return ubatch, tile if tile and ubatch % tile == 0 else 0

    @property
    def swa_full(self) -> bool:
        """Whether the main context keeps every cell of its sliding-window layers: the
        prefix cache reads prompts at any length, and a context whose sequences move into
        it (engine.side_prefill) must keep them too."""
        return self.n_cached_seqs > 0 and self.n_swa > 0

    @property
    def attention_on_cpu(self) -> bool:
        """Whether some layer's attention runs on the CPU: no GPU build, or layers kept off
        the GPU (`n_gpu_layers` 0 or fewer than the model has)."""
        if self.cfg.n_gpu_layers == 0 or not self.ll.llama_supports_gpu_offload():
            return True
        return 0 < self.cfg.n_gpu_layers < self.n_layer

    def _gpu_offload(self) -> bool:
        return self.cfg.n_gpu_layers != 0 and bool(self.ll.llama_supports_gpu_offload())

    def _device_greedy(self) -> bool:
        if self.cfg.device_greedy is not None:
            return self.cfg.device_greedy
        return self._gpu_offload()

    def open_context(
        self, *, n_ctx: int, n_seq_max: int, unified: bool, device_greedy: bool,
        n_ubatch: int | None = None, tap: ExpertTap | None = None, swa_full: bool = False,
    ) -> Context:  # fmt: skip
        """A further context on these weights (freed with the model)."""
        cfg = self.cfg
        ctx = Context(
            self.ll, self.model, n_ctx=n_ctx, n_seq_max=n_seq_max, n_batch=cfg.n_batch,
            n_ubatch=n_ubatch or cfg.n_ubatch, threads=cfg.threads(),
            flash_attn=cfg.flash_attn, unified=unified, device_greedy=device_greedy, tap=tap,
            swa_full=swa_full, score_rows=cfg.prompt_logprob_rows,
        )  # fmt: skip
        self.contexts.append(ctx)
        return ctx

    def close(self) -> None:
        for c in getattr(self, "contexts", []):
            c.close()
        self.contexts = []
        if getattr(self, "model", None):
            self.ll.llama_model_free(self.model)
            self.model = None

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
