"""`one-gpu serve|plan|experts …`: parse options; serve plans the placement, builds the
app and runs uvicorn; plan prints (or saves) a placement; experts reads a server's
router telemetry. `run` and `download` are deploy's (their own options)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from api.pipeline.generic_tools import GENERIC
from api.pipeline.tool_calls import FORMATS as TOOL_FORMATS
from engine.config import DEFAULT_PROMPT_LOGPROB_ROWS, SIDE_AUTO, EngineConfig
from engine.model import KV_PAD_CELLS
from engine.placement import CPU_MOE
from engine.plan import AUTO
from engine.sampling_defaults import FIELDS as SAMPLING_FIELDS
from engine.sampling_defaults import SamplingFlags

if TYPE_CHECKING:
    from api.server.state import ServerSettings

log = logging.getLogger("one-gpu")
# Measured cost on the H200 (docs/benchmarks.md, "Expert telemetry"): 0.4-1.1% of decode
# throughput at one step in 200; off (0) attaches nothing.
DEFAULT_EXPERT_SAMPLE_RATE = 0.005
N_BATCH, UBATCH = 2048, 512  # default tokens a step submits, rows of a physical batch
DEFAULT_CACHE_SEQS = 64  # prefix-cache holder ids: conversations kept, running prompts offered


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="one-gpu", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve a GGUF model behind an OpenAI-compatible API")
    s.add_argument("--model", help="GGUF file (default: the embedded Gemma 3 270M)")
    s.add_argument("--served-model-name", help="model id clients send (default: file stem)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8090)
    s.add_argument("--n-ctx", type=int, default=16384, help="KV pool size in tokens, all users")
    s.add_argument("--n-seq-max", type=int, default=32, help="most requests decoding at once")
    s.add_argument("--n-batch", type=int, default=N_BATCH, help="most tokens one step submits")
    s.add_argument(
        "--n-ubatch", type=int, default=None,
        help="physical batch of llama.cpp (default: 512; --n-batch where routed experts are "
        "in host RAM and a GPU computes prompts: one copy of them per step)",
    )  # fmt: skip
    s.add_argument("--max-num-batched-tokens", type=int, help="per-step token budget (<= n-batch)")
    s.add_argument("--max-model-len", type=int, help="per-request context limit")
    s.add_argument(
        "--max-stall-ms", type=_non_negative, default=None,
        help="while others decode, size prompt chunks so a step stays under this (0 = off; "
        "default: 250, longer where this machine needs larger chunks to prefill efficiently)",
    )  # fmt: skip
    s.add_argument("--min-prefill-chunk", type=int, default=32,
                   help="prompt tokens a step grants at least (prefill progresses)")  # fmt: skip
    s.add_argument("--threads", type=int, default=0, help="decode threads (0 = all cores)")
    s.add_argument("--threads-batch", type=int, default=0, help="batch threads (0 = --threads)")
    s.add_argument("--flash-attn", choices=["auto", "on", "off"], default="auto")
    s.add_argument("--n-gpu-layers", type=int, default=-1, help="layers on the GPU (-1 = all)")
    s.add_argument(
        "--cpu-experts", metavar="REGEX", action="append", default=[],
        help="keep tensors whose name matches REGEX in host RAM (repeatable)",
    )  # fmt: skip
    s.add_argument("--cpu-moe", action="store_true",
                   help="keep every routed expert in host RAM (llama.cpp's --cpu-moe)")  # fmt: skip
    _plan_options(s)
    s.add_argument("--mmap", action=argparse.BooleanOptionalAction, default=None,
                   help="map the model file, or read it into memory (default: read where a "
                   "GPU computes with tensors in host RAM: page-locked, DMA copies)")  # fmt: skip
    s.add_argument(
        "--plan", type=Path, metavar="FILE",
        help="apply a plan saved by `one-gpu plan --json` instead of planning",
    )  # fmt: skip
    s.add_argument("--plan-only", action="store_true",
                   help="print the placement this serve would use and exit (2: it does not "
                   "fit); `one-gpu run` checks it before binding and serving")  # fmt: skip
    s.add_argument(
        "--expert-sample-rate", type=float, default=DEFAULT_EXPERT_SAMPLE_RATE,
        help="share of steps whose MoE router choices are counted (0 = off, costs nothing)",
    )  # fmt: skip
    s.add_argument("--expert-cache-uploads", type=int, default=0, metavar="N",
                   help="experts a cached layer uploads after a step at most (0: the "
                   "experts one token uses; admission chooses which)")  # fmt: skip
    s.add_argument(
        "--expert-cache-misses", choices=["cpu", "gpu"], default="cpu",
        help="where cached layers compute the picks not in the bank: the CPU (a host round "
        "trip a layer) or the GPU reading host RAM in place over PCIe (decode steps)",
    )  # fmt: skip
    s.add_argument(
        "--expert-cache-admission", type=float, default=3.0, metavar="PICKS",
        help="a missed expert enters a full bank only when its recent picks (each decaying "
        "5%% a step) beat the weakest cached expert's by this many (0 = LRU: every miss)",
    )  # fmt: skip
    s.add_argument(
        "--device-greedy", choices=["auto", "on", "off"], default="off",
        help="sample plain greedy requests inside the graph (auto: when on a GPU; "
        "off by default: slower on the H200 at 32 users)",
    )  # fmt: skip
    s.add_argument(
        "--cpu-numerics", choices=["fork", "gpu"], default="fork",
        help="fork: requests share steps unless they send strata_reproducible=required; "
        "gpu: every request is served in the reproducible lane",
    )  # fmt: skip
    s.add_argument("--repro-slots", type=int, default=2,
                   help="requests the reproducible lane serves at once (0 = no lane)")  # fmt: skip
    s.add_argument("--repro-ctx", type=int, default=4096,
                   help="tokens per request in the reproducible lane (own KV stream)")  # fmt: skip
    s.add_argument("--repro-chunk", type=int, default=256,
                   help="prompt tokens per step in the reproducible lane (fixed)")  # fmt: skip
    s.add_argument("--max-waiting", type=int, default=256, help="queue bound before 429")
    s.add_argument(
        "--swap-space", type=_size, default=4 * 2**30, metavar="SIZE",
        help="host RAM for preempted requests' KV (saved, restored on resume, where cheaper "
        "than recomputing it; 0 = always recompute)",
    )  # fmt: skip
    s.add_argument(
        "--side-prefill-ctx", type=_count_or_auto(SIDE_AUTO, "tokens"), default=SIDE_AUTO,
        metavar="N|auto",
        help="a second context of N tokens prefills long prompts beside the decoders where "
        "no step carrying them keeps --max-stall-ms (0 = none; auto: up to 32768 where a "
        "GPU computes prompts with routed experts in host RAM)",
    )  # fmt: skip
    s.add_argument(
        "--cache-seqs", type=int, default=DEFAULT_CACHE_SEQS,
        help="conversations (and running prompts) whose KV the prefix cache keeps for later "
        "requests to read, as sequence ids beyond --n-seq-max",
    )  # fmt: skip
    s.add_argument("--no-prefix-cache", action="store_true",
                   help="compute every prompt in full (no prefix cache)")  # fmt: skip
    s.add_argument(
        "--prompt-logprob-rows", type=int, default=DEFAULT_PROMPT_LOGPROB_ROWS,
        help="logit rows a call returns for a prompt's own logprobs (completions echo + "
        "logprobs; such prompts go in chunks of this many tokens; 0 refuses them)",
    )  # fmt: skip
    s.add_argument(
        "--chat-template", type=Path,
        help="jinja2 chat template: a file, or a shipped one by name (gemma, chatml)",
    )  # fmt: skip
    s.add_argument(
        "--tool-call-parser", choices=("auto", *TOOL_FORMATS, GENERIC, "none"), default="auto",
        help="the model's tool-call format (vLLM's name); auto: from the chat template, else "
        "generic (the tools told in the system message, the answer a JSON object held to a "
        "grammar); none: requests with tools are refused",
    )  # fmt: skip
    _sampling_options(s)
    s.add_argument(
        "--accept-any-model", action="store_true",
        help="serve requests whatever `model` they name (as llama-server does; agent clients "
        "ask for their own model names); default: 404 for a name the server does not serve",
    )  # fmt: skip
    s.add_argument(
        "--reasoning-format", choices=("auto", "none"), default="auto",
        help="auto: a reasoning model's <think> block (its template writes <think>) goes to "
        "reasoning_content; none: it stays in content",
    )  # fmt: skip
    s.add_argument(
        "--api-key", action="append", default=[],
        help="require `Authorization: Bearer KEY` on /v1 (repeatable; visible in ps: prefer "
        "--api-key-file or $ONEGPU_API_KEY, comma-separated)",
    )  # fmt: skip
    s.add_argument("--api-key-file", type=Path, action="append", default=[],
                   help="file with one API key a line (repeatable)")  # fmt: skip
    s.add_argument("--protect-metrics", action="store_true",
                   help="/metrics and /experts need an API key too")  # fmt: skip
    s.add_argument("--drain-seconds", type=float, default=30.0, help="SIGTERM drain bound")
    s.add_argument("--max-request-bytes", type=_size, default=4 * 2**20, metavar="SIZE",
                   help="largest request body (413 above it; default 4MiB)")  # fmt: skip
    s.add_argument("--body-timeout", type=float, default=60.0,
                   help="seconds a request body may take to arrive (408)")  # fmt: skip
    s.add_argument("--max-messages", type=int, default=4096, help="messages per chat request")
    s.add_argument(
        "--max-connections", type=int, default=1024,
        help="open connections (the longest idle makes way; 503 when all are busy)",
    )  # fmt: skip
    s.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a request's headers may take to arrive (408)")  # fmt: skip
    s.add_argument("--keep-alive-timeout", type=float, default=15.0,
                   help="seconds an idle keep-alive connection is kept")  # fmt: skip
    s.add_argument("--log-level", default="info")

    sub.add_parser(
        "run", add_help=False,
        help="plan, bind to the GPU's NUMA node and serve on 0.0.0.0:8090 (deploy/run.sh; "
        "`one-gpu run --help`)",
    )  # fmt: skip
    sub.add_parser(
        "download", add_help=False,
        help="fetch a hub model into the cache, check it and exit (`one-gpu download --help`)",
    )  # fmt: skip
    pl = sub.add_parser("plan", help="decide which tensors live on the GPU and which in RAM")
    pl.add_argument("model", help="GGUF file")
    _plan_options(pl)
    pl.add_argument("--ctx", type=int, default=16384, help="context per sequence (tokens)")
    pl.add_argument("--parallel", type=int, default=1, help="sequences holding that context")
    pl.add_argument("--cache-seqs", type=int, default=DEFAULT_CACHE_SEQS,
                    help="serve's --cache-seqs (each id costs a row of logits)")  # fmt: skip
    pl.add_argument("--prompt-logprob-rows", type=int, default=DEFAULT_PROMPT_LOGPROB_ROWS,
                    help="serve's --prompt-logprob-rows")  # fmt: skip
    pl.add_argument("--n-ubatch", type=int, default=None,
                    help="serve's --n-ubatch (default: as serve chooses)")  # fmt: skip
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")

    ex = sub.add_parser("experts", help="a running server's most used experts and hot-set share")
    ex.add_argument("--url", default="http://127.0.0.1:8090")
    ex.add_argument("--top", type=int, default=20)
    ex.add_argument("--json", action="store_true")
    ex.add_argument("--save-counts", type=Path, metavar="FILE",
                    help="save the pick counts too, for `--pick-counts FILE`")  # fmt: skip
    return p


def _sampling_options(p: argparse.ArgumentParser) -> None:
    """llama-server's sampling options: what a request's unset fields become. Unset here:
    the model's own (its GGUF's general.sampling.*), else llama-server's default."""
    for f in SAMPLING_FIELDS:
        p.add_argument(
            f.flag, dest=f"sampling_{f.name}", type=_sampling_value(f.name), default=None,
            metavar="N", help=f"default {f.name} of a request that sets none (unset: the "
            f"model's own, else {f.default:g})",
        )  # fmt: skip


def _sampling_value(name: str) -> Any:
    field = next(f for f in SAMPLING_FIELDS if f.name == name)

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not field.valid(value):
            raise argparse.ArgumentTypeError(f"{text} is out of range for {name}")
        return int(value) if name == "top_k" else value

    return parse


def _sampling_flags(args: argparse.Namespace) -> SamplingFlags:
    return SamplingFlags(**{f.name: getattr(args, f"sampling_{f.name}") for f in SAMPLING_FIELDS})


def _plan_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--vram-budget", metavar="SIZE",
        help="GPU memory the plan may use, e.g. 80GiB (default: the GPU's free memory)",
    )  # fmt: skip
    p.add_argument("--ram-budget", metavar="SIZE",
                   help="host RAM the plan may use (default: MemAvailable, or less where "
                        "a cgroup memory limit leaves less)")  # fmt: skip
    p.add_argument(
        "--vram-margin", metavar="SIZE", type=_size, default=None,
        help="VRAM kept for the CUDA context and allocator beyond the modelled buffers "
        "(default 384MiB, measured on an H200 with CUDA 13)",
    )  # fmt: skip
    p.add_argument(
        "--expert-cache-slots", type=_count_or_auto(AUTO, "slots"), default=AUTO, metavar="N|auto",
        help="experts a layer the GPU caches for layers whose experts are in host RAM "
        "(default auto: on a GPU the plan splits the experts' VRAM between whole layers and "
        "slots; no cache without a GPU or with experts placed by hand; 0 = off)",
    )  # fmt: skip
    p.add_argument(
        "--pick-counts", type=Path, metavar="FILE",
        help="router pick counts (`one-gpu experts --save-counts`) the plan sizes the cache "
        "for and its bank starts with (default: those an earlier run saved in --state-dir, "
        "else uniform routing, the worst case)",
    )  # fmt: skip
    p.add_argument(
        "--state-dir", type=_state_dir, default="default", metavar="DIR|none",
        help="where a server saves its sampled router pick counts for its next start "
        "(default $ONEGPU_STATE_DIR, $XDG_STATE_HOME/one-gpu or ~/.local/state/one-gpu)",
    )  # fmt: skip


def _state_dir(text: str) -> Path | None:
    from engine.pick_store import default_state_dir

    if text == "default":
        return default_state_dir()
    return None if text == "none" else Path(text)


def _count_or_auto(auto: int, unit: str) -> Callable[[str], int]:
    """An argparse type for `N|auto` options: N >= 0, or `auto` as the option's sentinel."""

    def parse(text: str) -> int:
        if text == "auto":
            return auto
        n = int(text) if text.isdigit() else -1
        if n < 0:
            raise argparse.ArgumentTypeError(f"{text} is not a number of {unit} (N >= 0, or auto)")
        return n

    return parse


def _pick_counts(args: argparse.Namespace, model_path: str | None) -> Path | None:
    """The counts the plan and the cache's first fill read: --pick-counts, else those an
    earlier run of this model saved in --state-dir (engine.pick_store), if any."""
    if args.pick_counts is not None or args.state_dir is None or model_path is None:
        return args.pick_counts  # type: ignore[no-any-return]
    from engine.pick_store import counts_path

    try:
        saved = counts_path(args.state_dir, model_path)
    except OSError:  # no such model: the load says so
        return None
    if not saved.is_file():
        return None
    log.info("router pick counts saved by an earlier run: %s", saved)
    return saved


def _cache_options(args: argparse.Namespace, counts: Path | None) -> dict[str, Any]:
    """PlanOptions' keywords for the routed-expert cache (exits 2 on unreadable counts)."""
    from engine.expert_split import load_picks

    opts: dict[str, Any] = {"cache_slots": args.expert_cache_slots}
    if counts is not None:
        try:
            opts["picks"] = load_picks(counts.read_bytes())
        except (OSError, ValueError) as e:
            if counts != args.pick_counts:  # a saved file gone bad: plan without it
                log.warning("ignoring saved pick counts %s: %s", counts, e)
                return opts
            sys.stderr.write(f"one-gpu: cannot read --pick-counts {counts}: {e}\n")
            sys.exit(2)
    return opts


def _size(text: str) -> int:
    from engine.plan import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _margin(args: argparse.Namespace) -> dict[str, Any]:
    """PlanOptions' keyword for --vram-margin when given (else the planner's default)."""
    return {} if args.vram_margin is None else {"vram_margin": args.vram_margin}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:  # its own options, the rest are serve's
        from deploy.run import main as run

        sys.exit(run(argv[1:]))
    if argv[:1] == ["download"]:
        from deploy.download import main as download

        sys.exit(download(argv[1:]))
    args = _parser().parse_args(argv)
    if args.command == "plan":
        sys.exit(_plan(args))
    if args.command == "experts":
        sys.exit(_experts(args))
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    _serve(args)


def _plan(args: argparse.Namespace) -> int:
    from api.server.planning import PlanRequest, plan_model, plan_wide
    from engine._capi import llama
    from engine.devices import gpu_memory
    from engine.gguf_meta import read_meta
    from engine.plan import PlanDoesNotFit, PlanOptions, format_plan, output_rows, plan_to_json

    logging.basicConfig(level=logging.WARNING)
    if args.vram_budget is None and not gpu_memory(llama()):
        sys.stderr.write(
            "one-gpu plan: no GPU on this host; give --vram-budget SIZE to plan for one\n"
        )
        return 2
    opts = PlanOptions(
        kv_tokens=args.ctx * args.parallel, n_ubatch=args.n_ubatch or UBATCH,
        n_outputs=output_rows(args.parallel + max(0, args.cache_seqs), args.prompt_logprob_rows),
        **_margin(args), **_cache_options(args, _pick_counts(args, args.model)),
    )  # fmt: skip
    req = PlanRequest(vram_budget=args.vram_budget, ram_budget=args.ram_budget, options=opts)
    try:
        meta = read_meta(args.model)
        wide = args.n_ubatch is None  # as serve chooses with its default --n-batch
        plan = plan_wide(meta, req, N_BATCH) if wide else plan_model(meta, req)
    except PlanDoesNotFit as e:
        sys.stderr.write(f"one-gpu plan: does not fit\n{e}\n")
        return 2
    except ValueError as e:  # a budget that does not parse
        sys.stderr.write(f"one-gpu plan: {e}\n")
        return 2
    sys.stdout.write(plan_to_json(plan).decode() + "\n" if args.json else format_plan(plan) + "\n")
    return 0


def _experts(args: argparse.Namespace) -> int:
    import json
    import urllib.error

    from api.server.experts_client import fetch_counts, fetch_report, format_report, report_json

    try:
        r = fetch_report(args.url, args.top)
        if args.save_counts is not None:
            args.save_counts.write_bytes(fetch_counts(args.url))
    except urllib.error.HTTPError as e:  # the server's OpenAI-style error says why
        try:
            why = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            why = str(e)
        sys.stderr.write(f"one-gpu experts: {why}\n")
        return 2
    except OSError as e:
        sys.stderr.write(f"one-gpu experts: cannot reach {args.url}: {e}\n")
        return 2
    sys.stdout.write((report_json(r) if args.json else format_report(r)) + "\n")
    return 0


def _serve(args: argparse.Namespace) -> None:
    # The engine thread must get the GIL back at once when llama_decode returns; by default
    # a busy event loop (streaming to many clients) could hold it for up to 5 ms.
    sys.setswitchinterval(0.0005)
    from api.server.app import build_app
    from api.server.serve import serve

    settings = serve_settings(args)
    serve(build_app(settings), settings, args.host, args.port, args.log_level)


def _non_negative(v: str) -> float:
    x = float(v)
    if not x >= 0:  # (NaN too)
        raise argparse.ArgumentTypeError(f"{v} is not a time in ms (0 = off)")
    return x


def serve_settings(args: argparse.Namespace) -> ServerSettings:
    """What `serve` runs with: the engine, its plan, the limits (exits 2 on a plan that
    does not fit; with --plan-only, prints the plan and exits)."""
    from api.pipeline.lanes import LaneOptions
    from api.server.auth import load_keys
    from api.server.limits import ConnectionLimits, RequestLimits
    from api.server.state import ServerSettings

    model_path = args.model
    if model_path is None:
        from engine.default_model import DEFAULT_MODEL_NAME, default_model_path

        model_path = default_model_path()
        args.served_model_name = args.served_model_name or DEFAULT_MODEL_NAME
    counts = _pick_counts(args, model_path)
    engine = EngineConfig(
        model_path=model_path,
        n_ctx=args.n_ctx,
        n_seq_max=args.n_seq_max,
        n_cached_seqs=0 if args.no_prefix_cache else max(0, args.cache_seqs),
        n_batch=args.n_batch,
        n_ubatch=args.n_ubatch or UBATCH,
        prompt_logprob_rows=max(0, args.prompt_logprob_rows),
        n_threads=args.threads,
        n_threads_batch=args.threads_batch,
        flash_attn=args.flash_attn,
        n_gpu_layers=args.n_gpu_layers,
        device_greedy={"auto": None, "on": True, "off": False}[args.device_greedy],
        cpu_tensors=tuple(args.cpu_experts) + ((CPU_MOE,) if args.cpu_moe else ()),
        expert_sample_rate=args.expert_sample_rate,
        # a number: that many slots even without a plan (placement by hand, or no GPU: a
        # cache on the CPU, for tests); auto: as the plan splits the experts' VRAM
        expert_cache_slots=max(0, args.expert_cache_slots),
        expert_cache_admission=max(0.0, args.expert_cache_admission),
        expert_cache_misses=args.expert_cache_misses,
        expert_cache_fill=None if counts is None else str(counts),
        expert_cache_uploads=args.expert_cache_uploads,
        use_mmap=args.mmap,
        side_prefill_ctx=args.side_prefill_ctx,
    )
    lanes = LaneOptions(
        cpu_numerics=args.cpu_numerics,
        slots=args.repro_slots,
        ctx=-(-args.repro_ctx // KV_PAD_CELLS) * KV_PAD_CELLS,
        chunk=args.repro_chunk,
    )
    from api.server.planning import PlanRefused, PlanRequest, plan_for_serve
    from engine.plan import PlanOptions, format_plan, output_rows

    opts = PlanOptions(
        kv_tokens=engine.n_ctx + lanes.slots * lanes.ctx,
        n_ubatch=max(engine.n_ubatch, lanes.chunk) if lanes.slots else engine.n_ubatch,
        contexts=2 if lanes.slots else 1,
        # a row of logits per sequence id, the cache's holders too (device greedy: two ids)
        n_outputs=output_rows(
            max(engine.n_seq_max + engine.n_cached_seqs, lanes.slots), engine.prompt_logprob_rows
        ),
        **_margin(args),
        **_cache_options(args, counts),
    )
    req = PlanRequest(vram_budget=args.vram_budget, ram_budget=args.ram_budget, options=opts)
    try:
        engine, plan = plan_for_serve(engine, req, args.plan, wide_batches=args.n_ubatch is None)
    except (PlanRefused, ValueError) as e:
        log.error("not serving: %s", e)
        sys.exit(2)
    if plan is not None:
        log.info("placement plan:\n%s", format_plan(plan))
    if args.plan_only:
        sys.stdout.write((format_plan(plan) if plan else "no GPU: every tensor in RAM") + "\n")
        sys.exit(0)
    settings = ServerSettings(
        engine=engine,
        served_model_name=args.served_model_name,
        chat_template=args.chat_template,
        reasoning_format=args.reasoning_format,
        tool_call_parser=args.tool_call_parser,
        sampling=_sampling_flags(args),
        accept_any_model=args.accept_any_model,
        max_waiting=args.max_waiting,
        swap_space=args.swap_space,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        max_stall_ms=250.0 if args.max_stall_ms is None else (args.max_stall_ms or None),
        stall_auto=args.max_stall_ms is None,
        min_prefill_chunk=args.min_prefill_chunk,
        api_keys=load_keys(args.api_key, args.api_key_file),
        protect_metrics=args.protect_metrics,
        limits=RequestLimits(
            max_bytes=args.max_request_bytes,
            body_timeout_s=args.body_timeout,
            max_messages=args.max_messages,
        ),
        connections=ConnectionLimits(
            max_connections=args.max_connections,
            header_timeout_s=args.header_timeout,
            keep_alive_s=args.keep_alive_timeout,
        ),
        drain_s=args.drain_seconds,
        lanes=lanes,
        plan=plan,
        state_dir=args.state_dir,
    )
    return settings


if __name__ == "__main__":
    main()
