"""python -m step0_model "text": the model's top next tokens for a text, optionally checked against HF.

python -m step0_model "The Python interpreter" --top 10
python -m step0_model "The Python interpreter" --check     # also loads HF GPT2LMHeadModel, prints max |diff|
"""

from __future__ import annotations

import argparse
import os
import sys

try:  # torch loads here: Ctrl-C meanwhile exits quietly with 130, as later in the start-up
    import torch

    from common.tokenizer import Tokenizer
    from common.weights import resolve_model

    from .model import GPT
except KeyboardInterrupt:
    print(file=sys.stderr)
    sys.exit(130)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ArgumentParser(argparse.ArgumentParser):
    """argparse, reporting bad options as every error of this command line: one line, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see --help)\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        prog="python -m step0_model",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("prompt", help="the text whose next token is predicted")
    parser.add_argument(
        "--model",
        default="demo",
        help="'demo' (bundled), a Hub id or alias such as gpt2, or a local snapshot folder",
    )
    parser.add_argument(
        "--top", type=int, default=10, help="how many of the most likely next tokens to print"
    )
    parser.add_argument(
        "--check", action="store_true", help="compare all logits with Hugging Face GPT2LMHeadModel"
    )
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="weights and activations")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.device.split(":")[0] not in ("cpu", "cuda") or (
            args.device.startswith("cuda") and not torch.cuda.is_available()
        ):
            raise ValueError(f"--device {args.device}: must be cpu, or cuda on a machine with a CUDA GPU")
        folder = resolve_model(args.model)
        tokenizer = Tokenizer(folder)
        model = GPT.from_pretrained(str(folder), device=args.device, dtype=DTYPES[args.dtype])
        ids = tokenizer.encode(args.prompt)
        if not ids:
            raise ValueError("prompt: must contain at least one token")
        if max(ids) >= model.config.vocab_size:  # a tokenizer may name more tokens than the model embeds
            raise ValueError(
                f"prompt: token id {max(ids)} is outside the model's vocabulary of {model.config.vocab_size}"
            )
        if len(ids) > model.config.n_positions:
            raise ValueError(
                f"prompt: {len(ids)} tokens, more than the context window of {model.config.n_positions}"
            )
        if args.top < 1:
            raise ValueError("--top: must be >= 1")
    except (ValueError, ConnectionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    input_ids = torch.tensor([ids], device=args.device)  # [1, T]
    with torch.inference_mode():
        logits = model(input_ids)  # [1, T, V]
    probs = torch.softmax(logits[0, -1].float(), dim=-1)  # [V]
    top = torch.topk(probs, min(args.top, probs.numel()))
    print(f"{len(ids)} prompt tokens; the {len(top.indices)} most likely next tokens:")
    for p, i in zip(top.values.tolist(), top.indices.tolist()):
        print(f"  {p:7.2%}  {i:6d}  {tokenizer.decode([i])!r}")

    if args.check:
        from transformers import GPT2LMHeadModel
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf = GPT2LMHeadModel.from_pretrained(folder, dtype=DTYPES[args.dtype]).to(args.device).eval()
        with torch.inference_mode():
            hf_logits = hf(input_ids).logits  # [1, T, V]
        diff = (logits.float() - hf_logits.float()).abs().max().item()
        print(f"max |logits - HF logits| over {len(ids)} positions x {logits.shape[-1]} tokens: {diff:.3e}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C: no traceback, the shell's status for SIGINT
        print(file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:  # the reader went away (`... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
