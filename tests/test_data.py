"""Datasets (JSONL, Parquet, built-in), malformed-row accounting, sharded resumable loader, encoding."""

import json
import logging

import numpy as np
import pytest

from jaxrl.data import DataLoader, PromptDataset, encode_demonstrations, encode_prompts, sft_batch
from models.tokenizer import CharTokenizer


def _write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_loads_rows_with_default_and_explicit_task(tmp_path):
    p = _write_jsonl(tmp_path / "d.jsonl", [
        json.dumps({"problem": "1+1?", "answer": "2", "solution": "..."}),
        "",
        json.dumps({"problem": "rev ab", "answer": "ba", "task": "reverse"}),
    ])
    ds = PromptDataset.from_jsonl(p, prompt_key="problem")
    assert list(ds) == [{"prompt": "1+1?", "answer": "2", "task": "math", "solution": "..."},   # other columns kept
                        {"prompt": "rev ab", "answer": "ba", "task": "reverse"}]
    assert ds.skipped == 0 and ds.skipped_example is None
    assert PromptDataset.from_file(p, prompt_key="problem").rows == ds.rows
    assert PromptDataset.from_jsonl(p, prompt_key="problem", extra_columns=()).rows[0] == \
        {"prompt": "1+1?", "answer": "2", "task": "math"}


def test_jsonl_malformed_rows_are_skipped_counted_and_logged(tmp_path, caplog):
    p = _write_jsonl(tmp_path / "bad.jsonl", [
        json.dumps({"prompt": "ok", "answer": "1"}),
        json.dumps({"prompt": "no answer"}),
        "{not json",
        json.dumps({"prompt": 3, "answer": "x"}),
        json.dumps({"prompt": "null answer", "answer": None}),
        json.dumps(["a", "list"]),
        json.dumps({"prompt": "   ", "answer": "x"}),
        json.dumps({"prompt": "ok2", "answer": "2", "task": 5}),
        json.dumps({"prompt": "fine", "answer": "3"}),
    ])
    with caplog.at_level(logging.WARNING, logger="jaxrl.data.dataset"):
        ds = PromptDataset.from_jsonl(p)
    assert [r["prompt"] for r in ds] == ["ok", "fine"]
    assert ds.skipped == 7
    assert "line 2" in ds.skipped_example and "missing 'answer'" in ds.skipped_example
    assert "no answer" in ds.skipped_example
    assert "skipped 7 malformed of 9 rows" in caplog.text and "missing 'answer'" in caplog.text


def test_no_valid_rows_is_an_error(tmp_path):
    p = _write_jsonl(tmp_path / "empty.jsonl", [json.dumps({"q": "x", "a": "y"})])
    with pytest.raises(ValueError, match="no valid rows.*missing 'prompt'"):
        PromptDataset.from_jsonl(p)


def test_parquet_loads_only_valid_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"problem": ["a?", None, "c?", "d?"], "answer": ["1", "2", None, "4"],
                      "solution": ["s"] * 4})
    path = tmp_path / "d.parquet"
    pq.write_table(table, path, row_group_size=2)
    ds = PromptDataset.from_parquet(path, prompt_key="problem")
    assert list(ds) == [{"prompt": "a?", "answer": "1", "task": "math", "solution": "s"},
                        {"prompt": "d?", "answer": "4", "task": "math", "solution": "s"}]
    assert ds.skipped == 2 and "row 1" in ds.skipped_example and "NoneType" in ds.skipped_example
    assert PromptDataset.from_file(path, prompt_key="problem").rows == ds.rows

    pq.write_table(pa.table({"prompt": ["x", "y"], "answer": [1, 2], "task": ["copy", "copy"]}), path)
    with pytest.raises(ValueError, match="'answer' is int"):
        PromptDataset.from_parquet(path)
    with pytest.raises(ValueError, match=r"no column\(s\) \['question'\]"):
        PromptDataset.from_parquet(path, prompt_key="question")


def test_extra_columns_survive_loading_jsonl_and_parquet(tmp_path, caplog):
    """JSON values of other columns are kept as they are (nested, null, missing in a JSONL row: absent); taken
    names and Parquet columns of a non-JSON type are not, with one warning each naming them."""
    import datetime

    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = _write_jsonl(tmp_path / "d.jsonl", [
        json.dumps({"prompt": "p", "answer": "1", "level": 3, "meta": {"tags": ["x"]}, "hint": None, "index": 9}),
        json.dumps({"prompt": "q", "answer": "2", "response": "taken", "level": 4})])
    with caplog.at_level(logging.WARNING, logger="jaxrl.data.dataset"):
        rows = PromptDataset.from_jsonl(jsonl).rows
    assert rows == [{"prompt": "p", "answer": "1", "task": "math", "level": 3, "meta": {"tags": ["x"]}, "hint": None},
                    {"prompt": "q", "answer": "2", "task": "math", "level": 4}]
    assert "['index', 'response'] not kept: the name is taken" in caplog.text
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"problem": ["a?", "b?"], "answer": ["1", "2"], "prompt": ["x", "y"], "level": [1, None],
                             "tags": [["a"], []], "when": [datetime.datetime(2024, 1, 1)] * 2}), path)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxrl.data.dataset"):
        rows = PromptDataset.from_parquet(path, prompt_key="problem").rows
    assert rows == [{"prompt": "a?", "answer": "1", "task": "math", "level": 1, "tags": ["a"]},
                    {"prompt": "b?", "answer": "2", "task": "math", "level": None, "tags": []}]
    assert "['when'] not read: not a JSON-like type (timestamp[us])" in caplog.text
    assert "['prompt'] not kept" in caplog.text          # the renamed prompt column's place is taken
    assert PromptDataset.from_parquet(path, prompt_key="problem", extra_columns=["level"]).rows[1] == \
        {"prompt": "b?", "answer": "2", "task": "math", "level": None}


def test_builtin_dataset():
    ds = PromptDataset.builtin(["copy", "add"], 10, seed=0)
    assert len(ds) == 10 and [r["task"] for r in ds][:4] == ["copy", "add", "copy", "add"]
    assert ds.rows == PromptDataset.builtin(["copy", "add"], 10, seed=0).rows
    assert set(ds[0]) == {"prompt", "answer", "task"}


def _stream(loader, steps):
    return [r["index"] for _ in range(steps) for r in next(loader)]


@pytest.mark.parametrize("procs,n,batch", [(2, 24, 3), (3, 24, 4), (4, 32, 2), (3, 20, 2), (4, 6, 3)])
def test_sharding_is_disjoint_and_covers_each_epoch(procs, n, batch):
    ds = PromptDataset.builtin("copy", n, 0)
    steps = 3 * n // batch + 1                              # at least three epochs, batches may straddle
    # the global stream: one process taking the same global batch
    stream = _stream(DataLoader(ds, batch * procs, seed=5), steps)
    for e in range(len(stream) // n):
        assert sorted(stream[e * n:(e + 1) * n]) == list(range(n)), e   # every row once per epoch
    assert stream[:n] != stream[n:2 * n]                    # reshuffled per epoch
    shards = [_stream(DataLoader(ds, batch, process_index=p, process_count=procs, seed=5), steps)
              for p in range(procs)]
    for p in range(procs):
        assert shards[p] == stream[p::procs]                # process p: stream entries i ≡ p (mod procs)
    if n % procs == 0:                                      # then, inside an epoch, shards are disjoint
        for e in range(len(stream) // n):
            epoch_shards = [set(stream[e * n:(e + 1) * n][p::procs]) for p in range(procs)]
            assert set().union(*epoch_shards) == set(range(n))
            assert sum(map(len, epoch_shards)) == n


def test_one_process_epoch_is_a_permutation_and_no_shuffle_is_in_order():
    ds = PromptDataset.builtin("copy", 10, 0)
    ld = DataLoader(ds, 5, seed=1)
    got = [r["index"] for r in next(ld)] + [r["index"] for r in next(ld)]
    assert sorted(got) == list(range(10)) and got != list(range(10))
    assert ld.state_dict() == {"epoch": 1, "position": 0, "seed": 1}
    ld = DataLoader(ds, 4, shuffle=False)
    assert [[r["index"] for r in next(ld)] for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    assert next(DataLoader(ds, 1))[0]["prompt"] == ds[next(DataLoader(ds, 1))[0]["index"]]["prompt"]


@pytest.mark.parametrize("procs", [1, 3])
def test_resume_from_state_dict_gives_identical_batches(procs):
    ds = PromptDataset.builtin(["copy", "repeat"], 23, 0)     # 23 rows: batches straddle epochs
    for p in range(procs):
        ref = DataLoader(ds, 4, process_index=p, process_count=procs, seed=9)
        for _ in range(7):
            next(ref)
        state = ref.state_dict()
        expected = [next(ref) for _ in range(10)]
        resumed = DataLoader(ds, 4, process_index=p, process_count=procs, seed=0)
        resumed.load_state_dict(json.loads(json.dumps(state)))
        assert [next(resumed) for _ in range(10)] == expected


def test_cursor_is_global_across_process_counts():
    ds = PromptDataset.builtin("copy", 24, 0)
    single = DataLoader(ds, 6, seed=2)
    next(single)
    state = single.state_dict()
    rest = [r["index"] for _ in range(3) for r in next(single)]
    pair = [DataLoader(ds, 3, process_index=p, process_count=2) for p in range(2)]
    for ld in pair:
        ld.load_state_dict(state)
    shards = [[r["index"] for _ in range(3) for r in next(ld)] for ld in pair]
    assert sorted(shards[0] + shards[1]) == sorted(rest)
    assert not set(shards[0]) & set(shards[1])


def test_loader_rejects_bad_arguments_and_state():
    ds = PromptDataset.builtin("copy", 5, 0)
    with pytest.raises(ValueError, match="process_index 2"):
        DataLoader(ds, 2, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="batch_size"):
        DataLoader(ds, 0)
    ld = DataLoader(ds, 2)
    with pytest.raises(ValueError, match="does not fit"):
        ld.load_state_dict({"epoch": 0, "position": 5, "seed": 0})
    with pytest.raises(KeyError, match="position"):
        ld.load_state_dict({"epoch": 0, "seed": 0})


def test_encode_prompts_with_chat_template():
    tok = CharTokenizer()
    rows = [{"prompt": "rev ab", "answer": "ba", "task": "reverse"}]
    (ids,) = encode_prompts(rows, tok)
    assert tok.decode(ids) == "Q: rev ab\nA: "
    assert tok.decode(encode_prompts(rows, tok, chat=False)[0]) == "rev ab"


def test_demonstrations_and_sft_batch():
    tok = CharTokenizer()
    rows = list(PromptDataset.builtin(["copy", "add"], 4, 0))
    pairs = encode_demonstrations(rows, tok)
    for row, (p, r) in zip(rows, pairs):
        assert tok.decode(p) == f"Q: {row['prompt']}\nA: "
        assert r[-1] == tok.eos_ids[0] and tok.decode(r) == row["answer"]
    batch = sft_batch(pairs, pad_id=tok.pad_id)
    T = max(len(p) + len(r) for p, r in pairs)
    assert batch["tokens"].shape == batch["loss_mask"].shape == (4, T)
    for b, (p, r) in enumerate(pairs):
        assert batch["loss_mask"][b].sum() == len(r)
        np.testing.assert_array_equal(batch["tokens"][b][batch["loss_mask"][b] == 1], r)
        assert (batch["tokens"][b, len(p) + len(r):] == tok.pad_id).all()
    assert sft_batch(pairs, tok.pad_id, seq_len=T + 3)["tokens"].shape == (4, T + 3)
    with pytest.raises(ValueError, match="more than seq_len"):
        sft_batch(pairs, tok.pad_id, seq_len=T - 1)


def test_packed_sft_batch_keeps_every_sequence_with_its_own_positions():
    tok = CharTokenizer()
    pairs = encode_demonstrations(list(PromptDataset.builtin(["copy", "repeat", "add"], 40, 3)), tok)
    T = 160
    batch = sft_batch(pairs, tok.pad_id, T, pack=True)
    rows = batch["tokens"].shape[0]
    assert rows < len(pairs) and batch["tokens"].shape[1] == T
    assert batch["loss_mask"].sum() == sum(len(r) for _, r in pairs)
    seqs = []
    for b in range(rows):
        for s in range(1, batch["segment_ids"][b].max() + 1):
            sel = batch["segment_ids"][b] == s
            np.testing.assert_array_equal(batch["positions"][b][sel], np.arange(sel.sum()))
            response = sel & (batch["loss_mask"][b] == 1)
            seqs.append((batch["tokens"][b][sel].tolist(), batch["tokens"][b][response].tolist()))
    assert sorted(seqs) == sorted((list(p) + list(r), list(r)) for p, r in pairs)
    assert sft_batch(pairs, tok.pad_id, T, pack=True, num_rows=rows + 2)["tokens"].shape == (rows + 2, T)
    with pytest.raises(ValueError, match="num_rows"):
        sft_batch(pairs, tok.pad_id, T, pack=True, num_rows=rows - 1)
