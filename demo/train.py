"""Train the demo checkpoint: a small GPT-2 (``transformers.GPT2LMHeadModel``) on the tokenized Python docs.

    python demo/train.py --data demo/data --out demo/data/run            # one CUDA GPU, bf16 autocast
    python demo/train.py --device cpu --steps 5 --batch-size 2           # CPU smoke test
    python demo/train.py --device cpu --n-layer 2 --n-embd 128 --n-head 2 ...   # the demo draft (README)

Input: ``train.bin`` / ``val.bin`` from prepare_data.py (flat uint16 token ids, EOS 8191 between documents).
Output, in ``--out``: the model as ``save_pretrained`` writes it (config.json, model.safetensors in fp32),
``metrics.json`` (losses, perplexities, steps, tokens, wall time, hardware, versions) and, with
``--tokenizer``, a copy of vocab.json / merges.txt so that ``--out`` is a complete HF snapshot.

Recipe (after GPT-2 / nanoGPT):
    data       random windows of ``n_positions`` + 1 tokens of the training stream; the input is the first
               512 tokens, the target the same window shifted by one (next-token prediction)
    optimizer  AdamW, betas (0.9, 0.95), weight decay on matrices only (embeddings and linear weights;
               not biases or LayerNorm gains), gradient norm clipped at 1.0
    schedule   linear warm-up, then cosine decay to ``--min-lr-ratio`` x the peak learning rate
    precision  fp32 weights and optimizer state; bf16 autocast for the forward pass on CUDA only
    selection  the validation loss is measured every ``--eval-interval`` steps; the weights with the
               lowest validation loss are the ones saved (on a 1.6 M-token corpus a long run overfits)
The defaults (5000 steps of 32 x 512 tokens, about 50 epochs, dropout 0.2, peak lr 1e-3) are the recipe
of the bundled checkpoint: the best of a four-run sweep on one H200 (see demo/README.md).

References: Radford et al. 2019, "Language Models are Unsupervised Multitask Learners" (GPT-2);
Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization" (AdamW), ICLR;
Loshchilov & Hutter 2017, "SGDR" (cosine schedule), ICLR; Karpathy, nanoGPT (the training-loop shape).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB_SIZE = 8192
EOS_ID = VOCAB_SIZE - 1  # <|endoftext|>, the last id, as in GPT-2
PROMPTS = ["The Python interpreter", "A list comprehension", "The following example shows how"]


def make_config(dropout: float, n_layer: int = 6, n_embd: int = 256, n_head: int = 4) -> GPT2Config:
    """The demo model's architecture: GPT-2's, scaled down (by default 6 layers, 4 heads, width 256, context
    512; the demo draft for speculative decoding is 2 layers, 2 heads, width 128)."""
    return GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=512,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        activation_function="gelu_new",
        layer_norm_epsilon=1e-5,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=True,
    )


def load_tokens(path: Path, device: torch.device) -> torch.Tensor:
    """Read a uint16 .bin token file into an int64 tensor [n_tokens] on ``device``."""
    ids = np.fromfile(path, dtype=np.uint16).astype(np.int64)
    return torch.from_numpy(ids).to(device)


def random_windows(
    tokens: torch.Tensor, batch_size: int, context: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``batch_size`` windows of ``context + 1`` tokens at random offsets.

    Returns:
        x: [B, T] input ids, y: [B, T] target ids (x shifted left by one), both on ``tokens.device``.
    """
    starts = torch.randint(len(tokens) - context - 1, (batch_size,), generator=generator)
    offsets = starts.to(tokens.device)[:, None] + torch.arange(context + 1, device=tokens.device)  # [B, T+1]
    window = tokens[offsets]  # [B, T+1]
    return window[:, :-1], window[:, 1:]


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA; nothing on the CPU (the smoke test runs in plain fp32)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lm_loss(model: GPT2LMHeadModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats: x, y [B, T] -> scalar (the logits are upcast to fp32)."""
    logits = model(input_ids=x).logits  # [B, T, V]
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


@torch.no_grad()
def evaluate(
    model: GPT2LMHeadModel, tokens: torch.Tensor, context: int, batch_size: int, device: torch.device
) -> float:
    """Mean loss (nats per token) over consecutive, non-overlapping windows covering ``tokens``.

    Deterministic: the same tokens give the same number at every call. Dropout is off (eval mode).
    """
    was_training = model.training
    model.eval()
    n_windows = (len(tokens) - 1) // context
    starts = torch.arange(n_windows, device=tokens.device) * context
    total, count = 0.0, 0
    for i in range(0, n_windows, batch_size):
        offsets = starts[i : i + batch_size, None] + torch.arange(context + 1, device=tokens.device)
        window = tokens[offsets]  # [b, T+1]
        with autocast(device):
            loss = lm_loss(model, window[:, :-1], window[:, 1:])
        total += loss.item() * window.numel()
        count += window.numel()
    model.train(was_training)
    return total / count


def learning_rate(step: int, peak: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_ratio * peak`` at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(
    model: GPT2LMHeadModel, lr: float, weight_decay: float, device: torch.device
) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices (ndim >= 2) only; fused kernel on CUDA."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


@torch.no_grad()
def greedy_samples(
    model: GPT2LMHeadModel, tokenizer_dir: Path, device: torch.device, max_new_tokens: int = 40
) -> dict[str, str]:
    """Greedy continuations of ``PROMPTS`` (prompt -> generated text), with the HF tokenizer."""
    from transformers import GPT2TokenizerFast

    tokenizer = GPT2TokenizerFast.from_pretrained(str(tokenizer_dir))
    model.eval()
    samples = {}
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)  # [1, T]
        out = model.generate(
            ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=EOS_ID,
            attention_mask=torch.ones_like(ids),
        )
        samples[prompt] = tokenizer.decode(out[0, ids.size(1) :])
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description="Train the demo GPT-2 on train.bin / val.bin.")
    parser.add_argument("--data", type=Path, default=Path("demo/data"), help="folder with train.bin, val.bin")
    parser.add_argument("--out", type=Path, default=Path("demo/data/run"), help="output snapshot folder")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="folder with vocab.json, merges.txt: copied into --out, used for samples",
    )
    parser.add_argument("--steps", type=int, default=5000, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=32, help="windows of 512 tokens per step")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr / peak lr")
    parser.add_argument("--warmup", type=int, default=200, help="linear warm-up steps")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--n-layer", type=int, default=6, help="transformer blocks")
    parser.add_argument("--n-embd", type=int, default=256, help="model width")
    parser.add_argument("--n-head", type=int, default=4, help="attention heads (must divide --n-embd)")
    parser.add_argument("--eval-interval", type=int, default=100, help="steps between validation runs")
    parser.add_argument("--log-interval", type=int, default=50, help="steps between progress lines")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="stop after this many seconds of training (the best weights so far are saved)",
    )
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    train_tokens = load_tokens(args.data / "train.bin", device)
    val_tokens = load_tokens(args.data / "val.bin", device)
    print(f"data: {len(train_tokens):,} train tokens, {len(val_tokens):,} val tokens, device {device}")

    config = make_config(args.dropout, args.n_layer, args.n_embd, args.n_head)
    context = config.n_positions
    model = GPT2LMHeadModel(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters (embeddings tied), {config.n_layer} layers, width {config.n_embd}")
    optimizer = make_optimizer(model, args.lr, args.weight_decay, device)
    generator = torch.Generator().manual_seed(args.seed)
    # a fixed sample of training windows, to measure the train loss the same way as the val loss
    # (as many 512-token chunks as val.bin holds, evenly spaced over train.bin, concatenated)
    probe_starts = torch.linspace(0, len(train_tokens) - context - 1, max(2, len(val_tokens) // context))
    train_probe = torch.cat([train_tokens[int(s) : int(s) + context] for s in probe_starts])

    best = {"val_loss": float("inf"), "step": 0, "state": None}
    tokens_per_step = args.batch_size * context
    start = time.time()
    last_log = start
    model.train()
    steps_done = 0
    for step in range(1, args.steps + 1):
        lr = learning_rate(step - 1, args.lr, args.warmup, args.steps, args.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = random_windows(train_tokens, args.batch_size, context, generator)  # [B, T], [B, T]
        with autocast(device):
            loss = lm_loss(model, x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        steps_done = step
        out_of_time = args.time_limit is not None and time.time() - start > args.time_limit

        if step % args.log_interval == 0 or step == 1 or step == args.steps:
            loss_value = loss.item()  # synchronizes with the GPU
            now = time.time()
            n_steps = args.log_interval if step > 1 else 1
            ms = (now - last_log) * 1000 / n_steps
            last_log = now
            print(
                f"step {step:5d}/{args.steps} | loss {loss_value:.4f} | lr {lr:.2e} | "
                f"grad norm {grad_norm.item():.2f} | {ms:6.1f} ms/step | "
                f"{tokens_per_step / ms * 1000:,.0f} tok/s"
            )
        if step % args.eval_interval == 0 or step == args.steps or out_of_time:
            val_loss = evaluate(model, val_tokens, context, 64, device)
            improved = val_loss < best["val_loss"]
            if improved:
                best = {
                    "val_loss": val_loss,
                    "step": step,
                    "state": {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()},
                }
            print(
                f"eval step {step:5d} | val loss {val_loss:.4f} | val ppl {math.exp(val_loss):.2f}"
                f"{' | best' if improved else ''} | epochs {step * tokens_per_step / len(train_tokens):.1f}"
            )
            last_log = time.time()
        if out_of_time:
            print(f"time limit of {args.time_limit:.0f} s reached at step {step}: stopping")
            break
    wall = time.time() - start

    last_val_loss = evaluate(model, val_tokens, context, 64, device)
    last_train_loss = evaluate(model, train_probe, context, 64, device)
    model.load_state_dict(best["state"])
    val_loss = evaluate(model, val_tokens, context, 64, device)
    train_loss = evaluate(model, train_probe, context, 64, device)
    print(
        f"saved weights: step {best['step']} | train loss {train_loss:.4f} | val loss {val_loss:.4f} | "
        f"val ppl {math.exp(val_loss):.2f} | uniform ppl {VOCAB_SIZE} (loss {math.log(VOCAB_SIZE):.4f})"
    )

    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float32).save_pretrained(args.out, safe_serialization=True)
    if args.tokenizer is not None:
        for name in ("vocab.json", "merges.txt"):
            shutil.copy(args.tokenizer / name, args.out / name)
    metrics = {
        "saved_step": best["step"],
        "train_loss": train_loss,
        "val_loss": val_loss,
        "val_perplexity": math.exp(val_loss),
        "uniform_loss": math.log(VOCAB_SIZE),
        "uniform_perplexity": VOCAB_SIZE,
        "last_step_train_loss": last_train_loss,
        "last_step_val_loss": last_val_loss,
        "steps": steps_done,
        "tokens_seen": steps_done * tokens_per_step,
        "epochs": steps_done * tokens_per_step / len(train_tokens),
        "train_tokens": len(train_tokens),
        "val_tokens": len(val_tokens),
        "parameters": n_params,
        "wall_time_s": wall,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "loss_note": "train/val loss: mean next-token cross-entropy in nats, eval mode, 512-token windows; "
        "train on a fixed sample of train.bin the size of val.bin",
    }
    if args.tokenizer is not None:
        metrics["greedy_samples"] = greedy_samples(model, args.tokenizer, device)
        for prompt, text in metrics["greedy_samples"].items():
            print(f"sample | {prompt!r} -> {text!r}")
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(f"wrote {args.out} ({wall:.0f} s of training)")


if __name__ == "__main__":
    main()
