"""Tokenizer loading: ``transformers.AutoTokenizer`` from the checkpoint folder, local files only."""

from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(model_dir: str) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"could not load a tokenizer from {model_dir}: {e}. The folder needs tokenizer files "
            "(tokenizer.json or tokenizer.model + tokenizer_config.json); nothing is downloaded.") from e
