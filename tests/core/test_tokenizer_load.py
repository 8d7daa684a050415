"""``tokenizer.load_tokenizer``: a folder naming the generic fast class loads without
``AutoTokenizer`` (which imports PyTorch) and gives the tokenizer ``AutoTokenizer`` gives - the
same class, vocabulary, special tokens, chat template, encodings and decodings; any other folder
goes through ``AutoTokenizer``."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from inferscale_jax import tokenizer as tokmod
from inferscale_jax.default_model import default_model_dir
from tests.support.server_util import REPO

TEXTS = ["hello world", "  leading spaces and\ttabs\n", "ünïcödé and emoji \U0001f600", "<|endoftext|> inside",
         "a" * 300, ""]


def folder(tmp_path, cls: str | None, drop_json: bool = False):
    path = tmp_path / f"tok-{cls}-{drop_json}"
    shutil.copytree(default_model_dir(), path)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if cls is None:
        cfg.pop("tokenizer_class", None)
    else:
        cfg["tokenizer_class"] = cls
    cfg_path.write_text(json.dumps(cfg))
    if drop_json:
        (path / "tokenizer.json").unlink()
    return str(path)


@pytest.mark.parametrize("cls", ["PreTrainedTokenizerFast", "TokenizersBackend"])
def test_generic_fast_class_loads_the_same_tokenizer_as_autotokenizer(tmp_path, cls):
    path = folder(tmp_path, cls)
    assert tokmod._generic_fast(path)
    ours, auto = tokmod.load_tokenizer(path), AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab() and len(ours) == len(auto)
    assert ours.special_tokens_map == auto.special_tokens_map and ours.all_special_ids == auto.all_special_ids
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (auto.bos_token_id, auto.eos_token_id,
                                                                        auto.pad_token_id)
    assert ours.chat_template == auto.chat_template
    for text in TEXTS:
        for special in (False, True):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == auto.encode(text, add_special_tokens=special)
            assert ours.decode(ids) == auto.decode(ids)
            assert ours.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    assert tokmod.encode_text(ours, TEXTS[2]) == tokmod.encode_text(auto, TEXTS[2])


@pytest.mark.parametrize("cls, drop_json", [(None, False), ("GPT2TokenizerFast", False),
                                            ("PreTrainedTokenizerFast", True)])
def test_other_folders_go_through_autotokenizer(tmp_path, monkeypatch, cls, drop_json):
    path = folder(tmp_path, cls, drop_json)
    assert not tokmod._generic_fast(path)
    import transformers

    seen = []
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: seen.append(a) or real(*a, **k))
    try:
        tokmod.load_tokenizer(path)
    except ValueError:
        pass  # (a folder without tokenizer.json may not load at all: AutoTokenizer was still the one asked)
    assert seen and seen[0][0] == path


def test_missing_tokenizer_says_what_the_folder_needs(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="needs tokenizer files"):
        tokmod.load_tokenizer(str(tmp_path / "empty"))


def test_the_generic_path_does_not_import_torch():
    code = ("import sys; from inferscale_jax.tokenizer import load_tokenizer; "
            "from inferscale_jax.default_model import default_model_dir; load_tokenizer(default_model_dir()); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_the_engine_core_process_build_keeps_torch_out(tmp_path):
    """``serve``'s core process (spawned: the CLI's own mark is not inherited) builds its engine
    with torch marked absent, so even a tokenizer that needs ``AutoTokenizer`` imports no torch."""
    path = folder(tmp_path, "GPT2TokenizerFast")
    code = ("import sys; from inferscale_cli.main import build_parser; from inferscale_cli.serve import build_engine; "
            f"e = build_engine(build_parser().parse_args(['serve', '--model', {path!r}, '--no-warmup'])); "
            "print(e.tokenizer is not None, sys.modules.get('torch') is None)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "True True"
