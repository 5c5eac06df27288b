"""Conversation files of every supported format -> tokenized dataset; bad rows; the cache."""

from __future__ import annotations

import json

import pytest

import headstart.trainer.data as data_mod
from headstart.trainer.conversations import RowError, detect_format, to_messages
from headstart.trainer.data import DataConfig, build_dataset


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


ROWS = {
    "sharegpt": {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi?"},
                                   {"from": "gpt", "value": "Hello."}]},
    "messages": {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]},
    "instruction": {"instruction": "Add them.", "input": "2 and 3", "response": "5"},
    "gsm8k": {"question": "What is 2+3?", "answer": "2+3=<<2+3=5>>5\n#### 5"},
}


@pytest.mark.parametrize("fmt", sorted(ROWS))
def test_formats_normalise_to_messages(fmt):
    row = ROWS[fmt]
    assert detect_format(row) == fmt
    messages = to_messages(row, fmt)
    assert messages[-1]["role"] == "assistant"
    assert [m["role"] for m in messages if m["role"] != "system"] == ["user", "assistant"]


def test_instruction_joins_input_and_reads_output():
    messages = to_messages({"instruction": "Add them.", "input": "2 and 3", "output": "5"}, "instruction")
    assert messages == [{"role": "user", "content": "Add them.\n\n2 and 3"}, {"role": "assistant", "content": "5"}]


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}, "unknown role 'bot'"),
        ({"messages": [{"role": "assistant", "content": "a"}]}, "'user' was expected"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "  "}]}, "empty assistant"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": 3}]}, "must be a string"),
        ({"messages": [{"role": "user", "content": "a"}]}, "no assistant turn"),
        ({"conversations": [{"from": "alien", "value": "a"}]}, "unknown speaker"),
        ({"messages": [{"role": "user"}]}, "must have 'role' and 'content'"),
    ],
)
def test_bad_rows_raise_with_reason(row, reason):
    with pytest.raises(RowError, match=reason):
        to_messages(row, detect_format(row))


def test_build_dataset_every_file_type(tmp_path, chatml_tokenizer):
    import datasets

    files = [write_jsonl(tmp_path / f"{fmt}.jsonl", [ROWS[fmt]] * 3) for fmt in ROWS]
    (tmp_path / "arr.json").write_text(json.dumps([ROWS["instruction"]] * 2))
    datasets.Dataset.from_list([ROWS["gsm8k"]] * 2).to_parquet(str(tmp_path / "g.parquet"))
    files += [str(tmp_path / "arr.json"), str(tmp_path / "g.parquet")]
    ds, summary = build_dataset(DataConfig(files=tuple(files), max_length=64), chatml_tokenizer)
    assert len(ds) == summary.rows_kept == summary.rows_read == 16
    assert summary.tokens == sum(len(x) for x in ds["input_ids"])
    assert 0 < summary.trainable_tokens < summary.tokens
    for ids, mask in zip(ds["input_ids"], ds["loss_mask"]):
        assert len(ids) == len(mask) and any(mask)


def test_bad_row_error_names_file_and_row(tmp_path, chatml_tokenizer):
    good = ROWS["messages"]
    bad = {"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}
    path = write_jsonl(tmp_path / "chat.jsonl", [good, good, bad, good])
    with pytest.raises(ValueError, match=r"chat\.jsonl row 2: turn 1 has unknown role 'bot'"):
        build_dataset(DataConfig(files=(path,)), chatml_tokenizer)


def test_skip_bad_rows_counts_reasons(tmp_path, chatml_tokenizer):
    good = ROWS["messages"]
    empty = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]}
    order = {"messages": [{"role": "assistant", "content": "a"}]}
    path = write_jsonl(tmp_path / "chat.jsonl", [good, empty, order, empty, good])
    ds, summary = build_dataset(DataConfig(files=(path,), skip_bad_rows=True), chatml_tokenizer)
    assert len(ds) == summary.rows_kept == 2
    assert summary.rows_read == 5
    assert summary.skipped == {"turn N is an empty assistant turn": 2,
                               "turn N is 'assistant' but 'user' was expected (system?, then user/assistant alternating)": 1}
    assert "rows skipped                3" in summary.format()


def test_truncation_that_removes_all_trainable_tokens_is_counted(tmp_path, chatml_tokenizer):
    long_prompt = {"messages": [{"role": "user", "content": "word " * 50}, {"role": "assistant", "content": "ok"}]}
    path = write_jsonl(tmp_path / "chat.jsonl", [long_prompt, ROWS["messages"]])
    ds, summary = build_dataset(DataConfig(files=(path,), max_length=32), chatml_tokenizer)
    assert len(ds) == 1 and summary.truncated == 1
    assert summary.skipped == {"no trainable tokens after truncation": 1}


def test_missing_file_and_unknown_keys(tmp_path, chatml_tokenizer):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        build_dataset(DataConfig(files=(str(tmp_path / "nope.jsonl"),)), chatml_tokenizer)
    path = write_jsonl(tmp_path / "odd.jsonl", [{"prompt": "a", "completion": "b"}])
    with pytest.raises(ValueError, match=r"odd\.jsonl: cannot detect the row format"):
        build_dataset(DataConfig(files=(path,)), chatml_tokenizer)


def test_no_chat_template_is_a_clear_error(tmp_path):
    from conftest import make_tokenizer

    tok = make_tokenizer("", "<|im_end|>")
    tok.chat_template = None
    path = write_jsonl(tmp_path / "chat.jsonl", [ROWS["messages"]])
    with pytest.raises(ValueError, match="has no chat template"):
        build_dataset(DataConfig(files=(path,)), tok)
    # Preformatted text needs no template.
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": "plain words here"}])
    ds, _ = build_dataset(DataConfig(files=(text,)), tok)
    assert all(ds[0]["loss_mask"])


def test_second_run_reads_the_cache(tmp_path, chatml_tokenizer, monkeypatch):
    path = write_jsonl(tmp_path / "chat.jsonl", [ROWS["messages"]] * 20)
    config = DataConfig(files=(path,), num_proc=2)
    first, s1 = build_dataset(config, chatml_tokenizer)

    def fail(*args, **kwargs):
        raise AssertionError("tokenized again despite an identical cache entry")

    monkeypatch.setattr(data_mod, "_tokenize_file", fail)
    second, s2 = build_dataset(config, chatml_tokenizer)
    assert second["input_ids"] == first["input_ids"] and s1 == s2
    # A change of options or file contents is a different entry.
    with pytest.raises(AssertionError, match="tokenized again"):
        build_dataset(DataConfig(files=(path,), max_length=8), chatml_tokenizer)
    write_jsonl(tmp_path / "chat.jsonl", [ROWS["messages"]])
    with pytest.raises(AssertionError, match="tokenized again"):
        build_dataset(config, chatml_tokenizer)


def test_a_row_slice_reads_those_rows_and_names_bad_rows_by_their_row_in_the_file(tmp_path, chatml_tokenizer):
    rows = [{"messages": [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"answer {i}."}]}
            for i in range(6)]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    assert data_mod.split_rows(path + "[2:4]") == (path, 2, 4)
    assert data_mod.split_rows(path + "[3:]") == (path, 3, None)
    assert data_mod.split_rows(path) == (path, 0, None)
    whole, _ = build_dataset(DataConfig(files=(path,)), chatml_tokenizer)
    part, summary = build_dataset(DataConfig(files=(path + "[2:4]",)), chatml_tokenizer)
    assert part["input_ids"] == whole["input_ids"][2:4] and summary.rows_read == 2
    tail, _ = build_dataset(DataConfig(files=(path + "[4:]",)), chatml_tokenizer)
    assert tail["input_ids"] == whole["input_ids"][4:]
    # Two slices of one file are two cache entries, not one.
    assert data_mod.cache_key(DataConfig(files=(path + "[2:4]",)), chatml_tokenizer) != \
        data_mod.cache_key(DataConfig(files=(path + "[4:]",)), chatml_tokenizer)
    with pytest.raises(ValueError, match=r"has 6 rows, none from row 9"):
        build_dataset(DataConfig(files=(path + "[9:]",)), chatml_tokenizer)
    with pytest.raises(ValueError, match="empty row range 4:2"):
        build_dataset(DataConfig(files=(path + "[4:2]",)), chatml_tokenizer)
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl$"):
        build_dataset(DataConfig(files=(str(tmp_path / "nope.jsonl") + "[1:2]",)), chatml_tokenizer)
    rows[4] = {"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}
    write_jsonl(tmp_path / "chat.jsonl", rows)
    with pytest.raises(ValueError, match=r"chat\.jsonl row 4: turn 1 has unknown role 'bot'"):
        build_dataset(DataConfig(files=(path + "[3:6]",)), chatml_tokenizer)
    # A file whose name really ends in a bracketed range is read as written.
    literal = write_jsonl(tmp_path / "odd.jsonl[1:2]", rows[:3])
    assert data_mod.split_rows(literal) == (literal, 0, None)
