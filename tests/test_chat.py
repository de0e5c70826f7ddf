"""Text prompts and the chat template: ``reasonkv.generate`` applies it by default as ``reasonkv generate`` does
(``chat=False`` / ``--no-chat`` opt out), never twice, and token ids are decoded from as they are."""

from __future__ import annotations

import json

import pytest

import reasonkv
from conftest import CharTokenizer, tiny_llama
from reasonkv.cli import main
from reasonkv.eval.prompts import build_prompt
from reasonkv.generation.chat import chat_prompt, is_templated
from reasonkv.generation.inputs import encode_prompt


class ChatTokenizer(CharTokenizer):
    """A character tokenizer with a chat template: a default system turn unless the conversation has one."""

    eos_token_id = None
    chat_template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    all_special_tokens = ["<|"]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        if messages[0]["role"] != "system":
            messages = [{"role": "system", "content": "Be kind."}, *messages]
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")


class BareTurnTokenizer(ChatTokenizer):
    """A template that puts nothing before the user's words: only the assistant's opening tells it."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        return messages[-1]["content"] + ("\n<|assistant|>" if add_generation_prompt else "")


def test_text_goes_into_the_template_once_and_a_tokenizer_without_one_leaves_it_plain():
    tok = ChatTokenizer()
    templated = chat_prompt(tok, "What is 2 + 3?")
    assert templated == "<|system|>Be kind.\n<|user|>What is 2 + 3?\n<|assistant|>"
    assert chat_prompt(tok, templated) == templated and is_templated(tok, templated)
    assert build_prompt(tok, "2 + 3?").startswith("<|system|>") and is_templated(tok, build_prompt(tok, "2 + 3?"))
    own_system = tok.apply_chat_template([{"role": "system", "content": "Terse."}, {"role": "user", "content": "hi"}])
    assert chat_prompt(tok, own_system) == own_system  # a conversation with its own system turn is one too
    assert not is_templated(tok, "What is <|x|>?")
    assert chat_prompt(CharTokenizer(), "What is 2 + 3?") == "What is 2 + 3?"
    bare = BareTurnTokenizer()
    assert chat_prompt(bare, "2 + 3?") == "2 + 3?\n<|assistant|>" == chat_prompt(bare, chat_prompt(bare, "2 + 3?"))


def test_generate_templates_text_unless_chat_is_false_and_takes_token_ids_as_they_are():
    model, tok = tiny_llama(), ChatTokenizer()
    settings = dict(policy="streaming", budget=16, buffer=4, max_new_tokens=6)
    [chat] = reasonkv.generate(model, tok, "What is 2 + 3?", **settings)
    assert chat.prompt_tokens == len(chat_prompt(tok, "What is 2 + 3?"))
    [plain] = reasonkv.generate(model, tok, "What is 2 + 3?", chat=False, **settings)
    assert plain.prompt_tokens == len("What is 2 + 3?")
    ids = tok("What is 2 + 3?")["input_ids"]
    [given] = reasonkv.generate(model, tok, ids, **settings)  # ids: never templated, chat or not
    assert given.prompt_tokens == len(ids) and given.token_ids == plain.token_ids
    templated = build_prompt(tok, "What is 2 + 3?")
    [once] = reasonkv.generate(model, tok, templated, **settings)
    assert once.prompt_tokens == len(encode_prompt(tok, templated))
    with pytest.raises(ValueError, match="chat must be True or False, got 'no'"):
        reasonkv.generate(model, tok, "x", chat="no", max_new_tokens=2)


ISSUE = dict(policy="streaming", budget=16, buffer=4, max_new_tokens=24, temperature=0.0, seed=0)


@pytest.mark.integration
def test_the_bundled_instruct_model_answers_a_plain_question_through_the_api_as_through_the_command(
    smollm2, capsys, monkeypatch
):
    model, tok = smollm2
    monkeypatch.setattr("reasonkv.cli.generate.load_model_from", lambda args: smollm2)  # loaded once
    [answer] = reasonkv.generate(model, tok, ["What is 2 + 3?"], **ISSUE)
    assert answer.text.strip() and answer.num_tokens > 1 and "5" in answer.text
    [bare] = reasonkv.generate(model, tok, ["What is 2 + 3?"], chat=False, **ISSUE)
    assert bare.text == "" and bare.finish_reason == "eos"  # why templating is the default
    ids = tok("What is 2 + 3?")["input_ids"]
    [given] = reasonkv.generate(model, tok, ids, **ISSUE)
    assert given.prompt_tokens == len(ids) and given.token_ids == bare.token_ids
    [eval_prompt] = reasonkv.generate(model, tok, build_prompt(tok, "What is 2 + 3?"), **ISSUE)
    assert eval_prompt.prompt_tokens == len(encode_prompt(tok, build_prompt(tok, "What is 2 + 3?")))

    flags = ["--policy", "streaming", "--budget", "16", "--buffer", "4", "--max-new-tokens", "24", "--json"]
    for extra, expected in (([], answer), (["--no-chat"], bare)):
        assert main(["generate", "--prompt", "What is 2 + 3?", *flags, *extra]) == 0
        record = json.loads(capsys.readouterr().out)
        assert record["text"] == expected.text and record["tokens"] == expected.num_tokens
