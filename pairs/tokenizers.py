"""Tokenizer alignment of a target/draft pair (Hugging Face layout), without a network.

Speculative decoding verifies the draft's token ids with the target: when the two tokenizers map text to ids
differently, the target rejects drafts that meant the same text, acceptance collapses and serving gets slower
than not speculating at all. So before a draft engine starts, compare what decides the ids:

* the vocabulary size (the tokenizer's token-to-id map, added tokens included) and, where ``config.json``
  says it, the embedding rows of each model (``vocab_size``);
* the token-to-id map itself, by a stable hash (SHA-256 over the sorted ``token\\tid`` lines) and, when the
  hashes differ, how many ids differ;
* the special tokens (bos, eos, unk, pad and the additional ones) and the chat template: reported as
  notes, not as a misalignment. The server reads prompts, templates and stop tokens with the target's
  tokenizer and only exchanges ids with the draft, so a draft whose roles or template differ (an Instruct
  target with a base draft of its family) drafts the same ids; a special token whose *id* differs is in the
  map's differences already.

A model directory is read from its files: ``tokenizer.json`` (the tokenizers library's format, what fast
tokenizers save; BPE and WordPiece vocabularies are maps, Unigram ones lists), else ``vocab.json`` with
``added_tokens.json``; ``tokenizer_config.json`` and ``special_tokens_map.json`` for the special tokens and
the chat template (or ``chat_template.jinja`` / ``chat_template.json``); ``config.json`` for the embedding
rows. Where ``transformers`` is importable (the engine environment), :func:`read_tokenizer` can load the
tokenizer with it instead (``local_files_only``), which also reads SentencePiece-only directories; both
readers give the same facts for the same directory.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPECIAL_ROLES = ("bos_token", "eos_token", "unk_token", "pad_token")
# How many differing tokens a report names as examples: enough to recognise the kind of mismatch.
EXAMPLES = 5


class TokenizerUnreadable(Exception):
    """A model directory whose tokenizer cannot be read; the message says which file and why."""


def _map_hash(token_ids: Mapping[str, int]) -> str:
    lines = "".join(f"{token}\t{i}\n" for token, i in sorted(token_ids.items(), key=lambda t: (t[1], t[0])))
    return hashlib.sha256(lines.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class TokenizerFacts:
    """What decides the token ids of one model directory."""

    path: str
    token_ids: Mapping[str, int]
    special: Mapping[str, str | None]  # role (bos_token, ..., additional_special_tokens) -> token
    additional_special: tuple[str, ...]
    chat_template: str | None
    embedding_rows: int | None  # config.json vocab_size, when it says
    reader: str  # tokenizer.json, vocab.json or transformers
    # computed once: a large vocabulary takes a noticeable time to sort and hash
    map_hash: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "map_hash", _map_hash(self.token_ids))

    @property
    def vocab_size(self) -> int:
        return len(self.token_ids)

    def summary(self) -> dict[str, Any]:
        return {"path": self.path, "reader": self.reader, "vocab_size": self.vocab_size,
                "embedding_rows": self.embedding_rows, "map_hash": self.map_hash,
                "special": {role: self.special.get(role) for role in SPECIAL_ROLES},
                "additional_special": list(self.additional_special),
                "chat_template_hash": None if self.chat_template is None
                else hashlib.sha256(self.chat_template.encode()).hexdigest()[:16]}


@dataclass(frozen=True, slots=True)
class PairReport:
    """The comparison of a target's and a draft's tokenizers: aligned, or what differs."""

    aligned: bool
    differences: list[str]  # what makes the draft's ids mean other text: the pair is misaligned
    target: dict[str, Any]
    draft: dict[str, Any]
    ids_differ: int = 0
    examples: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what differs without changing what an id means

    def to_dict(self) -> dict[str, Any]:
        return {"aligned": self.aligned, "differences": self.differences, "notes": self.notes,
                "ids_differ": self.ids_differ, "examples": self.examples, "target": self.target,
                "draft": self.draft}

    def describe(self) -> str:
        if self.aligned:
            head = (f"aligned: {self.target['vocab_size']:,} tokens, the same token-to-id map "
                    f"({self.target['map_hash'][:12]})")
            if not self.notes:
                return head + ", special tokens and chat template"
            return f"{head}; but {'; '.join(self.notes)} (the server uses the target's)"
        return "; ".join(self.differences)


# --- reading a directory --------------------------------------------------------------------------------

def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerUnreadable(f"{path}: cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise TokenizerUnreadable(f"{path}: not JSON: {exc.msg} at line {exc.lineno}") from None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken-like mapping."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _vocab_from_tokenizer_json(path: Path) -> dict[str, int]:
    data = _json(path)
    if not isinstance(data, Mapping) or not isinstance(data.get("model"), Mapping):
        raise TokenizerUnreadable(f"{path}: no 'model' object")
    model = data["model"]
    vocab = model.get("vocab")
    ids: dict[str, int] = {}
    if isinstance(vocab, Mapping):  # BPE, WordPiece, WordLevel
        for token, i in vocab.items():
            if not isinstance(i, int):
                raise TokenizerUnreadable(f"{path}: model.vocab[{token!r}] is not an id")
            ids[str(token)] = i
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...], the id is the position
        for i, entry in enumerate(vocab):
            if not isinstance(entry, list) or not entry or not isinstance(entry[0], str):
                raise TokenizerUnreadable(f"{path}: model.vocab[{i}] is not [piece, score]")
            ids[entry[0]] = i
    else:
        raise TokenizerUnreadable(f"{path}: model.vocab is missing (model type {model.get('type')!r})")
    for added in data.get("added_tokens") or []:
        if isinstance(added, Mapping) and isinstance(added.get("content"), str) and isinstance(added.get("id"), int):
            ids[str(added["content"])] = int(added["id"])
    return ids


def _vocab_from_vocab_json(directory: Path) -> dict[str, int]:
    data = _json(directory / "vocab.json")
    if not isinstance(data, Mapping):
        raise TokenizerUnreadable(f"{directory / 'vocab.json'}: not a map of tokens to ids")
    ids = {str(token): int(i) for token, i in data.items() if isinstance(i, int)}
    added = directory / "added_tokens.json"
    if added.is_file():
        extra = _json(added)
        if isinstance(extra, Mapping):
            ids.update({str(token): int(i) for token, i in extra.items() if isinstance(i, int)})
    return ids


def _chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    separate = directory / "chat_template.json"
    if separate.is_file():
        data = _json(separate)
        if isinstance(data, Mapping) and isinstance(data.get("chat_template"), str):
            return str(data["chat_template"])
    template = config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):  # named templates: compare them all, in a stable form
        return json.dumps(template, sort_keys=True)
    return None


def _embedding_rows(directory: Path) -> int | None:
    path = directory / "config.json"
    if not path.is_file():
        return None
    data = _json(path)
    if not isinstance(data, Mapping):
        return None
    rows = data.get("vocab_size")
    if rows is None and isinstance(data.get("text_config"), Mapping):  # multimodal configs nest it
        rows = data["text_config"].get("vocab_size")
    return rows if isinstance(rows, int) else None


def _specials(directory: Path, config: Mapping[str, Any]) -> tuple[dict[str, str | None], tuple[str, ...]]:
    specials: dict[str, str | None] = {role: _token_text(config.get(role)) for role in SPECIAL_ROLES}
    additional = [t for t in (_token_text(v) for v in config.get("additional_special_tokens") or []) if t]
    mapped = directory / "special_tokens_map.json"
    if mapped.is_file():
        data = _json(mapped)
        if isinstance(data, Mapping):
            for role in SPECIAL_ROLES:
                if specials[role] is None:
                    specials[role] = _token_text(data.get(role))
            if not additional:
                additional = [t for t in (_token_text(v) for v in data.get("additional_special_tokens") or []) if t]
    return specials, tuple(additional)


def _read_files(directory: Path) -> TokenizerFacts:
    if (directory / "tokenizer.json").is_file():
        ids, reader = _vocab_from_tokenizer_json(directory / "tokenizer.json"), "tokenizer.json"
    elif (directory / "vocab.json").is_file():
        ids, reader = _vocab_from_vocab_json(directory), "vocab.json"
    elif (directory / "tokenizer.model").is_file():
        raise TokenizerUnreadable(f"{directory}: only tokenizer.model (SentencePiece), which needs transformers "
                                  "to read: run the check where transformers is installed (the engine environment)")
    else:
        raise TokenizerUnreadable(f"{directory}: no tokenizer.json, vocab.json or tokenizer.model")
    config_path = directory / "tokenizer_config.json"
    config = _json(config_path) if config_path.is_file() else {}
    if not isinstance(config, Mapping):
        raise TokenizerUnreadable(f"{config_path}: not a JSON object")
    specials, additional = _specials(directory, config)
    return TokenizerFacts(str(directory), ids, specials, additional, _chat_template(directory, config),
                          _embedding_rows(directory), reader)


def _read_transformers(directory: Path) -> TokenizerFacts:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a directory, never the hub
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # transformers raises many kinds; all mean the same here
        raise TokenizerUnreadable(f"{directory}: transformers cannot load the tokenizer: {exc}") from None
    specials = {role: _token_text(getattr(tok, role, None)) for role in SPECIAL_ROLES}
    additional = tuple(str(t) for t in getattr(tok, "additional_special_tokens", []) or [])
    template = getattr(tok, "chat_template", None)
    if isinstance(template, dict):
        template = json.dumps([{"name": k, "template": v} for k, v in sorted(template.items())], sort_keys=True)
    return TokenizerFacts(str(directory), dict(tok.get_vocab()), specials, additional,
                          template if isinstance(template, str) else None, _embedding_rows(directory), "transformers")


def read_tokenizer(directory: str | Path, *, use_transformers: bool = False) -> TokenizerFacts:
    """The facts of a model directory's tokenizer; TokenizerUnreadable says why not (whatever the files do:
    an unreadable or undecodable file, a permission refused)."""
    path = Path(directory)
    try:
        if not path.is_dir():
            raise TokenizerUnreadable(f"{path}: not a directory")
        return _read_transformers(path) if use_transformers else _read_files(path)
    except (OSError, UnicodeDecodeError, ValueError, TypeError) as exc:
        raise TokenizerUnreadable(f"{path}: cannot read the tokenizer: {exc}") from None


# --- comparing ------------------------------------------------------------------------------------------

def _count(n: int) -> str:
    return f"{n:,}"


def compare(target: TokenizerFacts, draft: TokenizerFacts) -> PairReport:
    """What differs between the two; aligned when nothing does."""
    differences: list[str] = []
    if target.vocab_size != draft.vocab_size:
        differences.append(f"draft has {_count(draft.vocab_size)} tokens, target {_count(target.vocab_size)}")
    if (target.embedding_rows is not None and draft.embedding_rows is not None
            and target.embedding_rows != draft.embedding_rows):
        differences.append(f"draft embeds {_count(draft.embedding_rows)} token rows, target "
                           f"{_count(target.embedding_rows)} (config.json vocab_size)")
    ids_differ = 0
    examples: list[dict[str, Any]] = []
    if target.map_hash != draft.map_hash:
        for token in sorted(set(target.token_ids) | set(draft.token_ids)):
            t, d = target.token_ids.get(token), draft.token_ids.get(token)
            if t != d:
                ids_differ += 1
                if len(examples) < EXAMPLES:
                    examples.append({"token": token, "target": t, "draft": d})
        differences.append(f"{_count(ids_differ)} ids differ (token-to-id maps {target.map_hash[:12]} and "
                           f"{draft.map_hash[:12]})")
    notes: list[str] = []
    for role in SPECIAL_ROLES:
        t_tok, d_tok = target.special.get(role), draft.special.get(role)
        t_id = None if t_tok is None else target.token_ids.get(t_tok)
        d_id = None if d_tok is None else draft.token_ids.get(d_tok)
        if (t_tok, t_id) != (d_tok, d_id):
            name = role.removesuffix("_token")
            notes.append(f"{name} differs (target {t_tok!r} id {t_id}, draft {d_tok!r} id {d_id})")
    if set(target.additional_special) != set(draft.additional_special):
        only_t = sorted(set(target.additional_special) - set(draft.additional_special))
        only_d = sorted(set(draft.additional_special) - set(target.additional_special))
        notes.append(f"additional special tokens differ (only the target's: {only_t[:EXAMPLES]}, only the "
                     f"draft's: {only_d[:EXAMPLES]})")
    if target.chat_template != draft.chat_template:
        if draft.chat_template is None or target.chat_template is None:
            which = "draft" if draft.chat_template is None else "target"
            notes.append(f"chat template differs (the {which} has none)")
        else:
            notes.append("chat template differs")
    return PairReport(not differences, differences, target.summary(), draft.summary(), ids_differ, examples, notes)


def check_pair(target_dir: str | Path, draft_dir: str | Path, *, use_transformers: bool = False) -> PairReport:
    """Read both directories and compare them; TokenizerUnreadable when either cannot be read."""
    return compare(read_tokenizer(target_dir, use_transformers=use_transformers),
                   read_tokenizer(draft_dir, use_transformers=use_transformers))
