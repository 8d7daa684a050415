"""Tokenizer loading (``transformers.AutoTokenizer`` from the checkpoint folder, local files only)
and the one encode/decode rule the engine, its async front and the server share.

A folder whose ``tokenizer_config.json`` names the generic fast class (``PreTrainedTokenizerFast``,
as Llama-3's does, or ``TokenizersBackend``) is loaded by that class directly - the class
``AutoTokenizer`` would pick - because importing ``AutoTokenizer`` imports transformers' model
configuration code and with it PyTorch: 2.6-3.1 s against 0.65 s in a fresh process on the CPU
machine, and a serve start's load waits on it (bench/NOTES.md, session 27)."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# the async fronts (AsyncEngine, the API server's CoreClient) encode a text up to this long on the
# event loop itself: a question of a few hundred tokens encodes in ~0.1 ms, less than the hop to a
# tokenizer thread and back (~0.3-0.5 ms of a request's time to first token; bench/NOTES.md,
# session 24); longer texts go to the thread pool, so no prompt holds the loop for long
INLINE_ENCODE_CHARS = 2048


GENERIC_FAST = ("PreTrainedTokenizerFast", "TokenizersBackend")  # AutoTokenizer's own choice for these names


def load_tokenizer(model_dir: str) -> PreTrainedTokenizerBase:
    try:
        if _generic_fast(model_dir):
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(model_dir, local_files_only=True)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"could not load a tokenizer from {model_dir}: {e}. The folder needs tokenizer files "
            "(tokenizer.json or tokenizer.model + tokenizer_config.json); nothing is downloaded.") from e


def _generic_fast(model_dir: str) -> bool:
    """Whether ``model_dir`` holds a ``tokenizer.json`` whose config names a generic fast class."""
    try:
        with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
            cls = json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        return False
    return cls in GENERIC_FAST and os.path.isfile(os.path.join(model_dir, "tokenizer.json"))


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The token ids of ``text`` as the engine sees them: no special tokens added (the engine
    adds the model's BOS itself, once, in front of the whole sequence)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def decode_ids(tokenizer: PreTrainedTokenizerBase | None, ids: list[int], sampling=None) -> str:
    """The text of generated ids; "" without a tokenizer.  ``sampling`` (a ``SamplingParams``, or
    None for the defaults) says whether special tokens are skipped (default) and, for slow
    tokenizers, whether spaces go between them."""
    if tokenizer is None:
        return ""
    if sampling is None or (sampling.skip_special_tokens and sampling.spaces_between_special_tokens):
        return tokenizer.decode(ids, skip_special_tokens=True)
    return tokenizer.decode(ids, skip_special_tokens=sampling.skip_special_tokens,
                            spaces_between_special_tokens=sampling.spaces_between_special_tokens)
