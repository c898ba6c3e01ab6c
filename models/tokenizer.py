"""Tokenizers: HF `tokenizer.json` (via the `tokenizers` library) with its chat template, and a
built-in character-level tokenizer for the built-in tasks (no downloads).

Both expose the same small surface the RL system needs: `encode`, `decode`, `apply_chat_template`,
`vocab_size`, `eos_ids`, `pad_id`. Chat templates are rendered the way `transformers` renders them:
Jinja2 in a sandboxed environment with `trim_blocks`/`lstrip_blocks`, `raise_exception` and `tojson`.
"""

from __future__ import annotations

import json
import os
import shutil
import string
from pathlib import Path
from typing import Protocol, Sequence

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer as _Tok, decoders, pre_tokenizers
from tokenizers import models as tok_models

Message = dict[str, str]


class Tokenizer(Protocol):
    vocab_size: int
    eos_ids: tuple[int, ...]
    pad_id: int

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...
    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True) -> str: ...


def _render(template: str, messages: list[Message], add_generation_prompt: bool, **special) -> str:
    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **special)


class HFTokenizer:
    """`tokenizer.json` + `tokenizer_config.json` (chat template, special tokens) from an HF directory."""

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        if not (path / "tokenizer.json").exists():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        self.path = path
        self._tok = _Tok.from_file(str(path / "tokenizer.json"))
        conf_path = path / "tokenizer_config.json"
        self.config = json.loads(conf_path.read_text()) if conf_path.exists() else {}
        template = self.config.get("chat_template")
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: use "default"
            template = {t["name"]: t["template"] for t in template}.get("default")
        self.chat_template = template
        self.special = {k: self._token_str(self.config.get(k)) for k in ("bos_token", "eos_token", "pad_token")}
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eos = self.special["eos_token"]
        gen_conf = path / "generation_config.json"
        eos_ids = []
        if gen_conf.exists():
            e = json.loads(gen_conf.read_text()).get("eos_token_id")
            eos_ids = list(e) if isinstance(e, list) else ([e] if e is not None else [])
        if eos is not None and self._tok.token_to_id(eos) is not None:
            eos_ids.append(self._tok.token_to_id(eos))
        self.eos_ids = tuple(dict.fromkeys(eos_ids))
        pad = self.special["pad_token"]
        self.pad_id = self._tok.token_to_id(pad) if pad is not None and self._tok.token_to_id(pad) is not None \
            else (self.eos_ids[0] if self.eos_ids else 0)

    @staticmethod
    def _token_str(t):
        return t.get("content") if isinstance(t, dict) else t

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template in tokenizer_config.json")
        return _render(self.chat_template, messages, add_generation_prompt,
                       **{k: v for k, v in self.special.items() if v is not None})


class CharTokenizer:
    """Printable-ASCII character tokenizer with <pad>=0, <bos>=1, <eos>=2 and a compact chat format
    ("Q: ...\nA: ").

    Unknown characters map to '?'. Used by the built-in tasks so the quickstart needs no download.
    """

    SPECIAL = ("<pad>", "<bos>", "<eos>")

    def __init__(self):
        chars = string.printable
        self._itos = list(self.SPECIAL) + list(chars)
        self._stoi = {c: i for i, c in enumerate(self._itos)}
        self.vocab_size = len(self._itos)
        self.pad_id, self.bos_id, self.eos_ids = 0, 1, (2,)

    def encode(self, text: str) -> list[int]:
        unk = self._stoi["?"]
        return [self._stoi.get(c, unk) for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        n, V = len(self.SPECIAL), len(self._itos)
        # ids past the vocabulary (models pad their embedding tables) decode to U+FFFD, as byte-level BPE does
        return "".join(self._itos[i] if i < V else "\ufffd" for i in ids if not (skip_special_tokens and i < n))

    # Compact role tags: every prompt character is a token (and is repeated for each of a GRPO group's
    # samples), so "Q:"/"A:" instead of "user:"/"assistant:" cuts the quickstart's training tokens ~1.6x.
    ROLES = {"user": "Q", "assistant": "A", "system": "S", "tool": "T"}   # tool: a tool's result (multi-turn)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True) -> str:
        text = "".join(f"{self.ROLES.get(m['role'], m['role'])}: {m['content']}\n" for m in messages)
        return text + ("A: " if add_generation_prompt else "")

    # The same chat format as a Jinja template, for exported checkpoints (transformers renders it).
    CHAT_TEMPLATE = ("{% set roles = {'user': 'Q', 'assistant': 'A', 'system': 'S', 'tool': 'T'} %}{% for m in messages %}"
                     "{{ roles.get(m['role'], m['role']) ~ ': ' ~ m['content'] ~ '\n' }}{% endfor %}"
                     "{% if add_generation_prompt %}{{ 'A: ' }}{% endif %}")

    def save(self, directory: str | os.PathLike) -> None:
        """This tokenizer as HF files: a char-level WordLevel `tokenizer.json` (every character its own
        token, unknown characters -> '?', decoding concatenates) and `tokenizer_config.json` with the chat
        template, so `transformers.AutoTokenizer` and `load_tokenizer(directory)` give the same ids.
        (One difference: the literal text "<eos>" in a prompt is one special token there, 5 characters here.)"""
        tok = _Tok(tok_models.WordLevel(vocab=dict(self._stoi), unk_token="?"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in self.SPECIAL])
        directory = Path(directory)
        tok.save(str(directory / "tokenizer.json"))
        (directory / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
            "pad_token": "<pad>", "chat_template": self.CHAT_TEMPLATE,
            "model_max_length": 1 << 30}, indent=2))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "added_tokens.json")


def save_tokenizer(tokenizer: Tokenizer, directory: str | os.PathLike) -> None:
    """Write `tokenizer`'s HF files into `directory` (an HF tokenizer's own files are copied as they are)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if isinstance(tokenizer, HFTokenizer):
        for name in TOKENIZER_FILES:
            if (tokenizer.path / name).is_file() and (tokenizer.path / name).resolve() != (directory / name).resolve():
                shutil.copyfile(tokenizer.path / name, directory / name)
    elif isinstance(tokenizer, CharTokenizer):
        tokenizer.save(directory)
    else:
        raise TypeError(f"cannot save a {type(tokenizer).__name__} as HF tokenizer files")


def load_tokenizer(path: str | os.PathLike | None) -> Tokenizer:
    """`HFTokenizer(path)`, or the built-in `CharTokenizer` when path is None or "char"."""
    if path is None or str(path) == "char":
        return CharTokenizer()
    return HFTokenizer(path)
