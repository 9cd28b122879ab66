"""The command line: stream a completion to the terminal, then one summary line.

    python -m <step> "The Python interpreter" --max-tokens 48
    python -m <step> "Once upon a time" --model gpt2 --temperature 0.8 --top-p 0.95 --seed 1

With several prompts (arguments, or --prompts-file with one per line) they run with continuous
batching and each completion is printed at the end, then the totals: throughput, preemptions, KV blocks.
"""

from __future__ import annotations

import argparse
import sys
import time

from .engine import DTYPES, LLM
from .sampling import SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {__package__}", description=__doc__.splitlines()[0])
    parser.add_argument("prompts", nargs="*", help="the texts to continue")
    parser.add_argument("--prompts-file", help="a text file with one prompt per line")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="most requests running at once")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV-cache blocks in the pool")
    parser.add_argument("--model", default="demo", help="'demo' (bundled), a Hub id or alias such as gpt2, or a local folder")
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep going after <|endoftext|>")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
            seed=args.seed,
        )
        prompts = list(args.prompts) + (read_prompts_file(args.prompts_file) if args.prompts_file else [])
        if not prompts:
            raise ValueError("prompts: give at least one prompt, as an argument or with --prompts-file")
        llm = LLM(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            max_num_seqs=args.max_num_seqs,
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
        )
        if len(prompts) > 1:
            return run_batch(llm, prompts, params)
        outputs = llm.stream_outputs(prompts[0], params)  # validates the request
    except (ValueError, ConnectionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    print(prompts[0], end="", flush=True)
    for out in outputs:
        print(out.delta, end="", flush=True)
    print()
    m = out.metrics
    decode = f"decode {m.decode_tokens_per_s:.1f} tok/s ({1e3 / m.decode_tokens_per_s:.1f} ms/token)" if m.decode_tokens_per_s else "decode n/a"
    print(
        f"[{len(out.prompt_token_ids)} prompt tokens, {len(out.token_ids)} generated ({out.finish_reason}), "
        f"TTFT {m.ttft_s * 1e3:.1f} ms, {decode}]",
        file=sys.stderr,
    )
    return 0


def read_prompts_file(path: str) -> list[str]:
    """The non-blank lines of a UTF-8 text file. Raises ValueError naming the file if it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return [line.rstrip("\r\n") for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--prompts-file {path}: {e.strerror if isinstance(e, OSError) else e}") from None


def run_batch(llm: LLM, prompts: list[str], params: SamplingParams) -> int:
    """Generate every prompt with continuous batching; print each completion, then the totals."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)  # validates every request first (ValueError)
    elapsed = time.perf_counter() - start
    for i, out in enumerate(outputs):
        print(f"--- request {i} ({len(out.token_ids)} tokens, {out.finish_reason}) ---")
        print(out.prompt + out.text)
    generated = sum(len(out.token_ids) for out in outputs)
    stats = llm.engine.stats
    print(
        f"[{len(outputs)} requests, up to {llm.engine.scheduler.max_num_seqs} at once: {generated} tokens generated "
        f"in {elapsed:.2f} s ({generated / elapsed:.1f} tok/s); {stats.num_preemptions} preemption(s); "
        f"KV cache of {stats.kv_blocks_total} blocks x {llm.engine.block_manager.block_size} tokens]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
