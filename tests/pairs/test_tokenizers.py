"""Tokenizer alignment of a target/draft pair (issue 19): read from Hugging Face directories, compared field by
field, each difference said plainly; the ``specgate check-pair`` command's answers and exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pairs import TokenizerUnreadable, check_pair, read_tokenizer
from specgate.cli import app
from tests.support.model_dirs import TEMPLATE, write_model

WORDS = [f"tok{i}" for i in range(200)]


def test_the_same_tokenizer_is_aligned(tmp_path: Path) -> None:
    report = check_pair(write_model(tmp_path / "t", WORDS), write_model(tmp_path / "d", WORDS))
    assert report.aligned
    assert report.differences == []
    assert report.target["map_hash"] == report.draft["map_hash"]
    assert report.target["vocab_size"] == 203
    assert report.target["special"] == {"bos_token": "<|user|>", "eos_token": "<|end|>", "unk_token": None,
                                        "pad_token": "<|pad|>"}
    assert "aligned: 203 tokens" in report.describe()


def test_a_draft_with_more_tokens_says_how_many_and_how_many_ids_differ(tmp_path: Path) -> None:
    extra = [f"more{i}" for i in range(64)]
    report = check_pair(write_model(tmp_path / "t", WORDS), write_model(tmp_path / "d", WORDS + extra))
    assert not report.aligned
    assert report.differences[0] == "draft has 267 tokens, target 203"
    assert report.differences[1] == "draft embeds 267 token rows, target 203 (config.json vocab_size)"
    assert report.differences[2].startswith("64 ids differ")
    assert report.ids_differ == 64
    assert report.examples[0] == {"token": "more0", "target": None, "draft": 203}


def test_the_same_tokens_under_other_ids_and_other_specials_are_each_named(tmp_path: Path) -> None:
    # One token swapped for another under the same id: the sizes agree, the maps do not.
    target = write_model(tmp_path / "t", WORDS)
    draft = write_model(tmp_path / "d", ["zzz", *WORDS[1:]], eos="<|user|>", template=None)
    report = check_pair(target, draft)
    assert not report.aligned
    assert report.differences == [
        f"2 ids differ (token-to-id maps {report.target['map_hash'][:12]} and {report.draft['map_hash'][:12]})"]
    assert report.notes == ["eos differs (target '<|end|>' id 2, draft '<|user|>' id 1)",
                            "chat template differs (the draft has none)"]
    assert {e["token"] for e in report.examples} == {"tok0", "zzz"}


def test_other_special_roles_or_chat_template_alone_are_notes_not_a_misalignment(tmp_path: Path) -> None:
    # An Instruct target with a base draft of its family: the same ids, other roles and no template. The
    # server reads prompts and stop tokens with the target's tokenizer, so the draft drafts the same ids.
    report = check_pair(write_model(tmp_path / "t", WORDS),
                        write_model(tmp_path / "d", WORDS, eos="<|pad|>", template=TEMPLATE.replace("assistant", "x")))
    assert report.aligned
    assert report.differences == []
    assert report.notes == ["eos differs (target '<|end|>' id 2, draft '<|pad|>' id 0)", "chat template differs"]
    assert report.describe().endswith("but eos differs (target '<|end|>' id 2, draft '<|pad|>' id 0); chat "
                                      "template differs (the server uses the target's)")


def test_a_file_that_is_not_text_is_unreadable_not_a_crash(tmp_path: Path) -> None:
    broken = write_model(tmp_path / "d", WORDS)
    (broken / "chat_template.jinja").write_bytes(b"\xff\xfe\x00 not utf-8")
    with pytest.raises(TokenizerUnreadable, match="cannot read the tokenizer"):
        read_tokenizer(broken)


@pytest.mark.parametrize("fmt", ["unigram", "vocab"])
def test_unigram_and_vocab_json_directories_read_to_the_same_facts(tmp_path: Path, fmt: str) -> None:
    bpe = read_tokenizer(write_model(tmp_path / "bpe", WORDS))
    other = read_tokenizer(write_model(tmp_path / fmt, WORDS, fmt=fmt))
    assert other.map_hash == bpe.map_hash
    assert other.reader == ("tokenizer.json" if fmt == "unigram" else "vocab.json")


def test_unreadable_directories_say_which_file_and_why(tmp_path: Path) -> None:
    with pytest.raises(TokenizerUnreadable, match="not a directory"):
        read_tokenizer(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerUnreadable, match=r"no tokenizer\.json, vocab\.json or tokenizer\.model"):
        read_tokenizer(tmp_path / "empty")
    sp = tmp_path / "sp"
    sp.mkdir()
    (sp / "tokenizer.model").write_bytes(b"\x00")
    with pytest.raises(TokenizerUnreadable, match="SentencePiece"):
        read_tokenizer(sp)
    broken = write_model(tmp_path / "broken", WORDS)
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerUnreadable, match=r"tokenizer\.json: not JSON"):
        read_tokenizer(broken)


def test_check_pair_command_exit_codes_text_and_json(tmp_path: Path) -> None:
    runner = CliRunner()
    target = write_model(tmp_path / "t", WORDS)
    same = write_model(tmp_path / "same", WORDS)
    other = write_model(tmp_path / "other", [*WORDS, "x"], eos="<|pad|>")
    ok = runner.invoke(app, ["check-pair", "--target", str(target), "--draft", str(same)])
    assert ok.exit_code == 0, ok.output
    assert ok.output.startswith("aligned: 203 tokens")
    bad = runner.invoke(app, ["check-pair", "--target", str(target), "--draft", str(other)])
    assert bad.exit_code == 1
    assert "  - draft has 204 tokens, target 203" in bad.output
    assert "  note: eos differs (target '<|end|>' id 2, draft '<|pad|>' id 0)" in bad.output
    as_json = runner.invoke(app, ["check-pair", "--target", str(target), "--draft", str(other), "--json"])
    assert as_json.exit_code == 1
    body = json.loads(as_json.output)
    assert body["aligned"] is False
    assert body["ids_differ"] == 1
    missing = runner.invoke(app, ["check-pair", "--target", str(target), "--draft", str(tmp_path / "nope")])
    assert missing.exit_code == 2
