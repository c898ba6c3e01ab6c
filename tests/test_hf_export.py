"""The HF export is a complete checkpoint: weights, config, tokenizer files and generation config, which
transformers and `python -m jaxrl.generate` load as they are (the char tokenizer too, id for id)."""

import json

import jax
import numpy as np
import pytest

from models import PRESETS, init, load_tokenizer, save_hf
from models.tokenizer import CharTokenizer

from .hf_util import write_bpe_tokenizer

TEXTS = ["copy abc", "Q: rev hello\nA: olleh", "add 12+30 = 42!", "tabs\tand é unicode"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(dir with the char tokenizer, dir with a BPE tokenizer, the BPE source dir)."""
    base = tmp_path_factory.mktemp("export")
    w_char = init(jax.random.key(0), PRESETS["tiny-char"])
    save_hf(base / "char", PRESETS["tiny-char"], w_char, tokenizer=CharTokenizer())
    src = write_bpe_tokenizer(base / "src")
    save_hf(base / "bpe", PRESETS["tiny-qwen3"], init(jax.random.key(1), PRESETS["tiny-qwen3"]),
            tokenizer=load_tokenizer(src))
    return base / "char", base / "bpe", src


def test_char_tokenizer_round_trips_through_hf_files(exported):
    import transformers

    char_dir = exported[0]
    ours, loaded = CharTokenizer(), load_tokenizer(char_dir)
    ref = transformers.AutoTokenizer.from_pretrained(char_dir)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "rev abc"}]
    chat = ours.apply_chat_template(msgs)
    assert loaded.apply_chat_template(msgs) == chat
    assert ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == chat
    for text in TEXTS + [chat]:
        ids = ours.encode(text)
        assert loaded.encode(text) == ids and ref(text, add_special_tokens=False)["input_ids"] == ids, text
        assert loaded.decode(ids) == ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert loaded.eos_ids == ours.eos_ids and loaded.vocab_size == ours.vocab_size
    gen = json.loads((char_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 and gen["pad_token_id"] == 0 and gen["bos_token_id"] == 1


def test_hf_tokenizer_files_are_copied_and_transformers_loads_the_model(exported):
    import torch
    import transformers

    _, bpe_dir, src = exported
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (bpe_dir / name).read_bytes() == (src / name).read_bytes()
    assert load_tokenizer(bpe_dir).eos_ids == load_tokenizer(src).eos_ids
    model = transformers.AutoModelForCausalLM.from_pretrained(bpe_dir)
    tok = transformers.AutoTokenizer.from_pretrained(bpe_dir)
    ids = tok("what is 2 + 3?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert np.isfinite(model(ids).logits.numpy()).all()
    assert model.generation_config.eos_token_id == load_tokenizer(src).eos_ids[0]


def test_generate_runs_on_the_export_with_its_own_tokenizer(exported, tmp_path):
    from jaxrl.generate import main

    char_dir = exported[0]
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "copy abc"}) + "\n")
    outs = []
    for extra in ([], ["tokenizer=char"]):      # the export's tokenizer (default) == the built-in one
        out = tmp_path / f"out{len(outs)}.jsonl"
        assert main([f"model.hf_path={char_dir}", f"input={tmp_path / 'p.jsonl'}", f"output={out}", "chat=true",
                     "sampling.max_new_tokens=6", "sampling.temperature=0", "engine.max_seq_len=64", *extra]) == 0
        outs.append([json.loads(line)["tokens"] for line in out.read_text().splitlines()])
    assert outs[0] == outs[1] and len(outs[0][0]) == 6
