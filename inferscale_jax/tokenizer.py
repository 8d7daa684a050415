"""Tokenizer loading (``transformers.AutoTokenizer`` from the checkpoint folder, local files only)
and the one encode/decode rule the engine, its async front and the server share."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# the async fronts (AsyncEngine, the API server's CoreClient) encode a text up to this long on the
# event loop itself: a question of a few hundred tokens encodes in ~0.1 ms, less than the hop to a
# tokenizer thread and back (~0.3-0.5 ms of a request's time to first token; bench/NOTES.md,
# session 24); longer texts go to the thread pool, so no prompt holds the loop for long
INLINE_ENCODE_CHARS = 2048


def load_tokenizer(model_dir: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"could not load a tokenizer from {model_dir}: {e}. The folder needs tokenizer files "
            "(tokenizer.json or tokenizer.model + tokenizer_config.json); nothing is downloaded.") from e


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
