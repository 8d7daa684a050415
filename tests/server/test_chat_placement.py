"""Segment placement inside chat templates (``serving/chat.py``) with Llama-3- and Qwen2-style
templates: the request's tokens are the template rendered with each segment's text inline, the
segments go into the system message by default, a template-written BOS is left to the engine."""

import asyncio
import copy

import pytest

from inferscale_jax import default_model_dir
from inferscale_jax.tokenizer import encode_text, load_tokenizer
from serving import chat
from serving.errors import APIError
from serving.schemas import ChatCompletionRequest

# the two template formats (Llama 3 and Qwen2 chat), written as jinja for the local tokenizer
LLAMA3 = ("<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
          "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
QWEN2 = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
         "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NO_SYSTEM = ("{% for m in messages if m['role'] != 'system' %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
             "{% if add_generation_prompt %}[assistant] {% endif %}")
SEGS = {"faq": "Acme warranty policy: two years from the date of purchase.",
        "prices": "Kettle 40 euros. Toaster 25 euros."}


@pytest.fixture(scope="module")
def base_tok(tmp_path_factory):
    return load_tokenizer(default_model_dir(str(tmp_path_factory.mktemp("cache"))))


def tokenizer(base, template):
    tok = copy.deepcopy(base)
    tok.chat_template = template
    return tok


def build(tok, body, bos=()):
    async def tokenize(text):
        return encode_text(tok, text)
    prompt = asyncio.run(chat.build(tok, ChatCompletionRequest.model_validate(body), tokenize, list(bos)))
    flat = [t for item in prompt.segments for t in (encode_text(tok, SEGS[item]) if isinstance(item, str) else item)]
    return prompt, flat + prompt.prompt_token_ids


def inline(tok, messages):
    return encode_text(tok, tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


@pytest.mark.parametrize("template", [LLAMA3, QWEN2], ids=["llama3", "qwen2"])
def test_named_segments_go_inside_the_system_message(base_tok, template):
    tok = tokenizer(base_tok, template)
    body = {"messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Warranty?"}],
            "segments": ["faq", "prices"]}
    prompt, tokens = build(tok, body)
    system = "Answer briefly.\n\n" + SEGS["faq"] + "\n\n" + SEGS["prices"]
    assert tokens == inline(tok, [{"role": "system", "content": system}, body["messages"][1]])
    # chain: [template prefix, faq, "\n\n", prices]; the rest of the template is the prompt
    assert [type(i).__name__ for i in prompt.segments] == ["list", "str", "list", "str"]
    assert prompt.segments[1::2] == ["faq", "prices"]


@pytest.mark.parametrize("template", [LLAMA3, QWEN2], ids=["llama3", "qwen2"])
def test_a_segment_content_part_sits_where_it_is_placed(base_tok, template):
    tok = tokenizer(base_tok, template)
    parts = [{"type": "text", "text": "Context:"}, {"type": "segment", "id": "faq"},
             {"type": "text", "text": "Is it transferable?"}]
    body = {"messages": [{"role": "user", "content": parts}]}
    _, tokens = build(tok, body)
    text = "Context:\n" + SEGS["faq"] + "\nIs it transferable?"
    assert tokens == inline(tok, [{"role": "user", "content": text}])
    # without a system message the named segments get one of their own (Qwen2 then drops its default)
    _, tokens = build(tok, {"messages": [{"role": "user", "content": "Hi"}], "segments": ["faq"]})
    assert tokens == inline(tok, [{"role": "system", "content": SEGS["faq"]}, {"role": "user", "content": "Hi"}])


def test_a_template_written_bos_is_left_to_the_engine_and_a_dropped_segment_is_a_400(base_tok):
    tok = tokenizer(base_tok, LLAMA3)
    bos = encode_text(tok, "<|begin_of_text|>")
    prompt, tokens = build(tok, {"messages": [{"role": "user", "content": "Hi"}], "segments": ["faq"]}, bos)
    full = inline(tok, [{"role": "system", "content": SEGS["faq"]}, {"role": "user", "content": "Hi"}])
    assert full[:len(bos)] == bos and tokens == full[len(bos):]
    with pytest.raises(APIError) as e:
        build(tokenizer(base_tok, NO_SYSTEM), {"messages": [{"role": "user", "content": "Hi"}], "segments": ["faq"]})
    assert e.value.status == 400 and "dropped" in str(e.value)
