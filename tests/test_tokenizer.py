"""The byte-level tokenizer and tokenizer loading from config."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from prime_train.config.schema import ModelConfig
from prime_train.engine.tokenizer import build_byte_tokenizer, load_tokenizer, padded_vocab_size
from prime_train.vocab import (
    BOS_TOKEN_ID,
    BYTE_VOCAB_SIZE,
    CHATML_TEMPLATE,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    SPECIAL_TOKENS,
)


@pytest.fixture(scope="module")
def tokenizer(byte_tokenizer):
    return byte_tokenizer


@settings(max_examples=300, deadline=None)
@given(text=st.text())
def test_byte_tokenizer_round_trips_any_utf8_text(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


@settings(max_examples=100, deadline=None)
@given(data=st.binary(min_size=1, max_size=64))
def test_byte_tokenizer_ids_are_the_utf8_bytes(tokenizer, data):
    text = data.decode("utf-8", errors="replace")
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == list(text.encode("utf-8"))


def test_byte_tokenizer_has_pad_bos_eos_and_chat_specials(tokenizer):
    assert len(tokenizer) == 256 + len(SPECIAL_TOKENS) == BYTE_VOCAB_SIZE
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == ("<|pad|>", "<|bos|>", "<|eos|>")
    assert len({tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}) == 3
    # the ids the supervisor side and a random-initialised model's config name without loading the tokenizer
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (
        PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID
    )  # fmt: skip
    # special tokens in text are single tokens, and skipped when decoding for display
    ids = tokenizer("<|im_start|>hi<|im_end|><|eos|>", add_special_tokens=False)["input_ids"]
    assert ids == [
        *tokenizer.convert_tokens_to_ids(["<|im_start|>"]),
        104,
        105,
        *tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|eos|>"]),
    ]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hi"
    # nothing is added around plain text: documents get their eos from the data pipeline
    assert tokenizer("ab")["input_ids"] == [97, 98]


def test_chat_template_renders_chatml_and_opens_an_assistant_turn(tokenizer):
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"


def test_saved_tokenizer_loads_with_autotokenizer_and_gives_the_same_ids(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "héllo wörld 🎉\n\t<|im_start|>user\n12+7=<|im_end|><|eos|>"
    assert loaded(text, add_special_tokens=False)["input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.bos_token_id) == (256, 258, 257)
    messages = [{"role": "user", "content": "hi"}]
    assert loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    assert loaded.chat_template == CHATML_TEMPLATE
    assert loaded.decode(loaded(text, add_special_tokens=False)["input_ids"]) == text


def test_load_tokenizer_without_tokenizer_or_path_builds_the_byte_tokenizer():
    tok = load_tokenizer(ModelConfig())
    assert len(tok) == 261 and tok.eos_token == "<|eos|>"


def test_load_tokenizer_prefers_model_tokenizer_over_model_path(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path / "plain")
    bigger = build_byte_tokenizer()
    bigger.add_tokens(["<|extra|>"])
    bigger.save_pretrained(tmp_path / "bigger")
    assert len(load_tokenizer(ModelConfig(tokenizer=str(tmp_path / "plain"), path=str(tmp_path / "bigger")))) == 261
    assert len(load_tokenizer(ModelConfig(path=str(tmp_path / "bigger")))) == 262


def test_load_tokenizer_pads_with_eos_when_the_tokenizer_has_no_pad(tmp_path):
    no_pad = PreTrainedTokenizerFast(tokenizer_object=build_byte_tokenizer().backend_tokenizer, eos_token="<|eos|>")
    assert no_pad.pad_token is None
    no_pad.save_pretrained(tmp_path)
    loaded = load_tokenizer(ModelConfig(tokenizer=str(tmp_path)))
    assert loaded.pad_token == "<|eos|>" and loaded.pad_token_id == loaded.eos_token_id


def test_load_tokenizer_errors_name_the_config_key(tmp_path):
    with pytest.raises(ValueError, match=r"model\.path = .*no such directory"):
        load_tokenizer(ModelConfig(path=str(tmp_path / "missing")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"model\.tokenizer = .*could not load a tokenizer"):
        load_tokenizer(ModelConfig(tokenizer=str(tmp_path / "empty")))


def test_padded_vocab_size_rounds_up_to_the_multiple(tokenizer):
    assert padded_vocab_size(tokenizer, 64) == 320
    assert padded_vocab_size(tokenizer, 1) == 261
    assert padded_vocab_size(tokenizer, 261) == 261
    with pytest.raises(ValueError, match="vocab_multiple"):
        padded_vocab_size(tokenizer, 0)


def test_the_byte_vocabulary_pads_to_llama_3s_whole_vocabulary():
    # scripts/gpu_layers_mfu.py pads the byte tokenizer to Llama 3's 128,256 ids so an 8B-shaped layer's lm_head costs
    # what the 8B's does; the schema's bound refused it (1 << 16) and the H200 run of 2026-11-29 lost its layers part
    model = ModelConfig(vocab_multiple=128256)
    assert padded_vocab_size(build_byte_tokenizer(), model.vocab_multiple) == 128256
    with pytest.raises(ValueError, match="vocab_multiple"):
        ModelConfig(vocab_multiple=(1 << 18) + 1)


@pytest.mark.parametrize(("model_type", "encodes_to"), [("qwen2", "nothing"), ("gemma", "unknown tokens only")])
def test_a_model_directory_without_tokenizer_files_is_an_error_not_an_empty_tokenizer(tmp_path, model_type, encodes_to):
    """transformers builds Qwen2's and Gemma's tokenizer classes with no vocabulary from a directory that holds only
    the model (save_pretrained of the model alone): every text became nothing or <unk> and the run trained on it."""
    from transformers import AutoConfig

    AutoConfig.for_model(model_type).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"model\.path = .*encodes text to {encodes_to}: it holds no tokenizer files"):
        load_tokenizer(ModelConfig(path=str(tmp_path)))
    build_byte_tokenizer().save_pretrained(tmp_path)
    assert load_tokenizer(ModelConfig(path=str(tmp_path)))("abc")["input_ids"]
