"""Tokenizer: HF tokenizer.json + chat template render exactly as transformers does; char tokenizer."""

import pytest

from models.tokenizer import CharTokenizer, load_tokenizer

from .hf_util import write_bpe_tokenizer

@pytest.fixture()
def hf_dir(tmp_path):
    return write_bpe_tokenizer(tmp_path)


def test_matches_transformers(hf_dir):
    import transformers

    ours = load_tokenizer(hf_dir)
    ref = transformers.AutoTokenizer.from_pretrained(hf_dir)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2 + 3?"}]
    text = ours.apply_chat_template(msgs)
    assert text == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours.encode(text) == ref(text, add_special_tokens=False)["input_ids"]
    ids = ours.encode("the answer is 5.")
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.eos_ids == (ref.convert_tokens_to_ids("<|im_end|>"),)


def test_no_template_is_an_error(hf_dir):
    (hf_dir / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="no chat_template"):
        load_tokenizer(hf_dir).apply_chat_template([{"role": "user", "content": "x"}])


def test_char_tokenizer_round_trip():
    tok = load_tokenizer("char")
    assert isinstance(tok, CharTokenizer)
    text = tok.apply_chat_template([{"role": "user", "content": "sum 12 30"}])
    assert text == "Q: sum 12 30\nA: "
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([1, *tok.encode("ok"), 2]) == "ok"
    assert max(tok.encode(text)) < tok.vocab_size
    assert tok.decode([tok.vocab_size + 5]) == "\ufffd"
