"""Step 0: the GPT-2 forward pass, from scratch, with logits equal to Hugging Face's."""

from .model import GPT

__all__ = ["GPT"]
