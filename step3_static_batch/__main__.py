"""The command line: stream a completion to the terminal, then one summary line.

    python -m <step> "The Python interpreter" --max-tokens 48
    python -m <step> "Once upon a time" --model gpt2 --temperature 0.8 --top-p 0.95 --seed 1

With several prompts (arguments, or --prompts-file with one per line) they run in static batches: each
completion is printed when all are done, then the totals: throughput and the waste (padding positions,
and positions computed for requests that had already finished). Run it from the repository root; the
CLI's defaults (greedy, 64 tokens) differ from the Python API's, vLLM's (temperature 1.0, 16 tokens).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

try:  # torch loads here: Ctrl-C meanwhile exits quietly with 130, as later in the start-up
    from .config import EngineArgs
    from .llm import LLM
    from .sampling_params import SamplingParams
except KeyboardInterrupt:
    print(file=sys.stderr)
    sys.exit(130)


class ArgumentParser(argparse.ArgumentParser):
    """argparse, reporting bad options as every error of this command line: one line, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see --help)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each option's default where it has one (not None, not an empty list)."""

    def _get_help_string(self, action):
        return (
            action.help
            if action.default is None or action.default == []
            else super()._get_help_string(action)
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        prog=f"python -m {__package__}",
        description=__doc__.split("\n\n")[0] + " The summary gives prompt and generated tokens, the time to "
        "first token (TTFT) and the decode speed.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("prompts", nargs="*", help="the texts to continue")
    parser.add_argument("--prompts-file", help="a UTF-8 text file with one prompt per line")
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="divides the logits; 0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 or -1 = off")
    parser.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="keep the most likely tokens up to this probability mass; 1 = off",
    )
    parser.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="drop tokens less likely than this times the best one; 0 = off",
    )
    parser.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="CTRL's penalty on tokens already seen; 1 = off"
    )
    parser.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="OpenAI's penalty on tokens generated at least once; 0 = off",
    )
    parser.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="OpenAI's penalty per time a token was generated; 0 = off",
    )
    parser.add_argument(
        "--stop", action="append", default=[], help="a stop string, left out of the output (repeatable)"
    )
    parser.add_argument("--ignore-eos", action="store_true", help="keep going after <|endoftext|>")
    parser.add_argument(
        "--seed", type=int, default=None, help="seed of the random draws; none = different every run"
    )
    EngineArgs.add_cli_args(parser)  # --model, --device, --dtype, ...: the engine's arguments
    return parser.parse_args(argv)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The sampling parameters of the command line (ValueError on a bad value)."""
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        params = sampling_params(args)
        prompts = list(args.prompts) + (read_prompts_file(args.prompts_file) if args.prompts_file else [])
        if not prompts:
            raise ValueError("prompts: give at least one prompt, as an argument or with --prompts-file")
        llm = LLM(EngineArgs.from_cli_args(args))
        if len(prompts) > 1:
            return run_batch(llm, prompts, params)
        seq = llm.engine.make_sequence("cli", prompts[0], params)  # validates the request
    except (ValueError, ConnectionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    print(prompts[0], end="", flush=True)
    shown = 0
    for _ in llm.engine.run([seq]):  # after every step: print the text it released
        print(seq.text[shown:], end="", flush=True)
        shown = len(seq.text)
    print()
    out, m = seq.output(), seq.metrics
    num_tokens = len(out.outputs[0].token_ids)
    decode = (
        f"decode {m.decode_tokens_per_s:.1f} tok/s ({1e3 / m.decode_tokens_per_s:.1f} ms/token)"
        if m.decode_tokens_per_s
        else "decode n/a"
    )
    print(
        f"[{len(out.prompt_token_ids)} prompt tokens, {num_tokens} generated "
        f"({out.outputs[0].finish_reason}), TTFT {m.ttft_s * 1e3:.1f} ms, {decode}]",
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
    """Generate every prompt; print each completion, then the totals."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)  # validates every request first (ValueError)
    elapsed = time.perf_counter() - start
    for i, out in enumerate(outputs):
        completion = out.outputs[0]
        print(f"--- request {i} ({len(completion.token_ids)} tokens, {completion.finish_reason}) ---")
        print(out.prompt + completion.text)
    generated = sum(len(out.outputs[0].token_ids) for out in outputs)
    print(
        f"[{len(outputs)} requests: {generated} tokens generated in {elapsed:.2f} s "
        f"({generated / elapsed:.1f} tok/s); {engine_summary(llm.engine)}]",
        file=sys.stderr,
    )
    return 0


def engine_summary(engine) -> str:
    return (
        f"static batches of up to {engine.max_batch_size}; waste: {engine.num_padding_tokens} padding "
        f"positions, {engine.num_wasted_tokens} positions computed for finished requests"
    )


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C: no traceback, the shell's status for SIGINT
        print(file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:  # the reader went away (`... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
