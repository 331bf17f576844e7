"""``python -m policies``: exit codes 0 (ok), 1 (invalid document or shape), 2 (usage)."""

from __future__ import annotations

import io
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from policies import RequestShape, canonical_document, compile_policy, load_policy, revision_id
from policies.__main__ import main
from policies.render import batch_size_schedule, vllm_serve_args
from tests.support import paths
from tests.support.policy_texts import INVALID_POLICY as INVALID

ROOT = paths.ROOT
EXAMPLES = sorted((ROOT / "policies" / "examples").glob("*.yaml"))
MULTI_ROUTE = ROOT / "policies" / "examples" / "multi-route.yaml"



@pytest.fixture
def invalid(tmp_path: Path) -> Path:
    path = tmp_path / "broken.yaml"
    path.write_text(INVALID)
    return path


def test_validate_examples(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", *map(str, EXAMPLES)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(EXAMPLES)
    for line, path in zip(out, EXAMPLES, strict=True):
        doc = load_policy(path.read_text())
        assert line == f"{path}: ok  policy={doc.name} revision={revision_id(doc)}"


def test_validate_invalid_lists_every_error_with_its_path(invalid: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(invalid)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"{invalid}: invalid (2 errors)" in captured.err
    assert "rules[0].when.batch_size.max (line 7)" in captured.err
    assert "rules[0].then.engine (line 8)" in captured.err
    assert "[undefined_engine]" in captured.err
    assert "engine 'drfat' is not defined" in captured.err


def test_validate_mixed_files_reports_each(invalid: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(EXAMPLES[0]), str(invalid)]) == 1
    captured = capsys.readouterr()
    assert f"{EXAMPLES[0]}: ok" in captured.out
    assert f"{invalid}: invalid" in captured.err


def test_validate_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.yaml"
    assert main(["validate", str(missing)]) == 2
    assert "nope.yaml" in capsys.readouterr().err


def test_validate_reads_stdin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(MULTI_ROUTE.read_bytes())))
    assert main(["validate", "-"]) == 0
    assert capsys.readouterr().out.startswith("-: ok  policy=fleet ")


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in ([], ["frobnicate"], ["validate"], ["render", str(MULTI_ROUTE)]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2, argv
    capsys.readouterr()


# --- decide ---------------------------------------------------------------------------

def test_decide_prints_one_decision_per_shape(capsys: pytest.CaptureFixture[str]) -> None:
    shapes = [
        {"route": "extract", "batch_size": 2},
        {"route": "chat", "batch_size": 6, "max_tokens": 64},
        {"route": "chat", "structured_output": True},
    ]
    argv = ["decide", str(MULTI_ROUTE), "--shape", json.dumps(shapes[0]), "--shape", json.dumps(shapes[1:])]
    assert main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    doc = load_policy(MULTI_ROUTE.read_text())
    policy = compile_policy(doc, revision_id(doc))
    assert [line["shape"] for line in lines] == shapes
    assert [line["decision"] for line in lines] == [
        policy.decide(RequestShape.from_dict(s)).to_dict() for s in shapes]
    assert [line["decision"]["rule"] for line in lines] == [
        "extract-ngram", "chat-draft-medium-batch", "no-structured"]
    assert lines[1]["decision"]["num_speculative_tokens"] == 2


def test_decide_reads_shapes_from_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps([{"route": "creative"}, {"route": "extract", "batch_size": 20}]))
    assert main(["decide", str(MULTI_ROUTE), "--shape", f"@{shapes}"]) == 0
    rules = [json.loads(line)["decision"]["rule"] for line in capsys.readouterr().out.splitlines()]
    assert rules == ["creative-plain", "default"]


def test_decide_invalid_shape_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["decide", str(MULTI_ROUTE), "--shape", '{"batch_size": "2", "colour": 1}']) == 1
    err = capsys.readouterr().err
    assert "batch_size" in err
    assert "colour" in err


def test_decide_invalid_document_exits_1(invalid: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["decide", str(invalid), "--shape", "{}"]) == 1
    assert "rules[0].then.engine" in capsys.readouterr().err


def test_decide_bad_json_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["decide", str(MULTI_ROUTE), "--shape", "{not json"]) == 2
    assert capsys.readouterr().err.startswith("error:")


def test_decide_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["decide", str(tmp_path / "nope.yaml"), "--shape", "{}"]) == 2
    assert main(["decide", str(MULTI_ROUTE), "--shape", f"@{tmp_path / 'nope.json'}"]) == 2
    capsys.readouterr()


# --- canonical ------------------------------------------------------------------------

@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_canonical(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["canonical", str(path)]) == 0
    captured = capsys.readouterr()
    doc = load_policy(path.read_text())
    assert json.loads(captured.out) == canonical_document(doc)
    assert captured.out.count("\n") == 1
    assert captured.err.strip() == revision_id(doc)


def test_canonical_invalid_and_missing(invalid: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["canonical", str(invalid)]) == 1
    assert main(["canonical", str(tmp_path / "nope.yaml")]) == 2
    assert capsys.readouterr().out == ""


# --- render ---------------------------------------------------------------------------

@pytest.mark.parametrize("engine", ["ngram", "draft"])
@pytest.mark.parametrize("schedule", [False, True])
def test_render_vllm_is_shell_ready(engine: str, schedule: bool, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["render", str(MULTI_ROUTE), "--engine", engine, "--max-num-seqs", "64"]
    if schedule:
        argv.append("--schedule")
    assert main(argv) == 0
    doc = load_policy(MULTI_ROUTE.read_text())
    rendered_schedule = batch_size_schedule(doc, engine, 64) if schedule else None
    expected = vllm_serve_args(doc, engine, schedule=rendered_schedule)
    assert shlex.split(capsys.readouterr().out) == expected


def test_render_quotes_awkward_model_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "quote.yaml"
    path.write_text(MULTI_ROUTE.read_text().replace("models/draft", "\"it's a $(model) name\""))
    assert main(["render", str(path), "--engine", "draft"]) == 0
    args = shlex.split(capsys.readouterr().out)
    assert json.loads(args[1])["model"] == "it's a $(model) name"


def test_render_trtllm(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["render", str(MULTI_ROUTE), "--engine", "ngram", "--target", "trtllm", "--schedule",
            "--max-num-seqs", "64"]
    assert main(argv) == 0
    assert capsys.readouterr().out == (ROOT / "tests" / "policies" / "golden" / "multi-route" /
                                       "ngram.trtllm-extra-options.yaml").read_text()


def test_render_plain_engine(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", str(MULTI_ROUTE), "--engine", "base"]) == 0
    assert capsys.readouterr().out.strip() == "--enable-per-request-metrics"
    assert main(["render", str(MULTI_ROUTE), "--engine", "base", "--target", "trtllm"]) == 0
    assert capsys.readouterr().out == "{}\n"


@pytest.mark.parametrize("argv", [
    ["--engine", "nope"],
    ["--engine", "base", "--schedule"],
    ["--engine", "ngram", "--schedule", "--max-num-seqs", "0"],
])
def test_render_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", str(MULTI_ROUTE), *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error:")


def test_render_invalid_document_exits_1(invalid: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", str(invalid), "--engine", "base"]) == 1
    assert "rules[0].then.engine" in capsys.readouterr().err


# --- the real entry point ---------------------------------------------------------------

def test_python_dash_m(invalid: Path, tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "policies", *args], capture_output=True, text=True,
                              cwd=ROOT, timeout=60, check=False)

    ok = run("validate", *map(str, EXAMPLES))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.count(": ok  policy=") == len(EXAMPLES)
    bad = run("validate", str(invalid))
    assert bad.returncode == 1
    assert "rules[0].then.engine" in bad.stderr
    assert run("validate", str(tmp_path / "nope.yaml")).returncode == 2
    assert run("--help").returncode == 0
