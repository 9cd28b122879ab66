"""The command line: stream a completion to the terminal, then one summary line.

    python -m <step> "The Python interpreter" --max-tokens 48
    python -m <step> "Once upon a time" --model gpt2 --temperature 0.8 --top-p 0.95 --seed 1
"""

from __future__ import annotations

import argparse
import sys

from .engine import DTYPES, LLM
from .sampling import SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {__package__}", description=__doc__.splitlines()[0])
    parser.add_argument("prompt", help="the text to continue")
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
        llm = LLM(model=args.model, device=args.device, dtype=args.dtype)
        outputs = llm.stream_outputs(args.prompt, params)  # validates the request
    except (ValueError, ConnectionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    print(args.prompt, end="", flush=True)
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


if __name__ == "__main__":
    sys.exit(main())
