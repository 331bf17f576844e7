"""The testbed's pair and its misaligned draft through the tokenizer check (pairs.tokenizers): the aligned
pair passes, whether its files are read directly or loaded with transformers (in the engine environment,
where transformers lives) the two readers agree; a draft trained with a tokenizer of its own is told apart
by what differs, and the testbed's set-up refuses a cache whose draft does not match its target."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from pairs import check_pair, read_tokenizer
from testbed import env
from testbed.models import ModelPaths, check_aligned, ensure, ensure_misaligned_draft

pytestmark = pytest.mark.engines

SCRIPT = r"""
import json, sys
from pairs import read_tokenizer
print(json.dumps({d: read_tokenizer(d, use_transformers=True).summary() for d in sys.argv[1:]}))
"""


def test_the_testbed_pair_is_aligned_by_both_readers() -> None:
    testbed = ensure(quiet=True)
    report = check_pair(testbed.models.target, testbed.models.draft)
    assert report.aligned, report.differences
    assert report.target["vocab_size"] == 1024
    result = subprocess.run([str(testbed.python), "-c", SCRIPT, str(testbed.models.target),
                             str(testbed.models.draft)], capture_output=True, text=True, env=env.engine_env(),
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    loaded = json.loads(result.stdout)
    for directory in (testbed.models.target, testbed.models.draft):
        by_files = read_tokenizer(directory).summary()
        by_transformers = loaded[str(directory)]
        assert by_transformers["reader"] == "transformers"
        for key in ("vocab_size", "map_hash", "special", "additional_special", "chat_template_hash", "embedding_rows"):
            assert by_transformers[key] == by_files[key], key


def test_a_draft_with_a_tokenizer_of_its_own_is_misaligned_and_the_set_up_refuses_it(tmp_path: Path) -> None:
    testbed = ensure(quiet=True)
    misaligned = ensure_misaligned_draft(testbed.python, quiet=True)
    report = check_pair(testbed.models.target, misaligned)
    assert not report.aligned
    # as many tokens, merged in another order: the sizes agree and most ids mean other text
    assert report.target["vocab_size"] == report.draft["vocab_size"]
    assert report.ids_differ > report.target["vocab_size"] // 2
    assert report.differences[0].startswith(f"{report.ids_differ:,} ids differ")
    # a cache whose draft is not its target's is refused with what differs
    root = tmp_path / "pair"
    shutil.copytree(testbed.models.target, root / "target")
    shutil.copytree(misaligned, root / "draft")
    with pytest.raises(RuntimeError, match="ids differ"):
        check_aligned(ModelPaths(root=root, target=root / "target", draft=root / "draft"))
