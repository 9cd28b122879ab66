"""The command line: serve the engine over HTTP with OpenAI's API (see server.py).

    python -m step7_cuda_graphs --model demo            # http://127.0.0.1:8000, the web page at /
    python -m step7_cuda_graphs --model gpt2 --device cuda --dtype float16 --port 8080

Run it from the repository root; `--help` lists every option with its default.
"""

from __future__ import annotations

import sys

from .server import main

if __name__ == "__main__":
    sys.exit(main())
