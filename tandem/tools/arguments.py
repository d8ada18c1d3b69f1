"""Command-line arguments that the commands loading a model share (generate, serve, eval, calibrate); argparse only,
so that any command can import it."""

from __future__ import annotations

import argparse


def add_model_source_arguments(p: argparse.ArgumentParser) -> None:
    """--model and --no-model-cache: which model is loaded (every command that loads one takes them)."""
    p.add_argument(
        "--model",
        default=None,
        help="local Hugging Face model directory or .gguf file, or a packaged model's name (gemma3-270m) "
        "(default: SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--no-model-cache",
        action="store_true",
        help="load a .gguf model from the file itself, not from its converted copy in the model cache "
        "($TANDEM_CACHE_DIR/models, default ~/.cache/tandem/models)",
    )
