"""Command line for policy documents: ``python -m policies --help``.

Exit codes: 0 success, 1 the document (or shape) is invalid, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from policies.bundle import canonical_document, canonical_json, revision_id
from policies.errors import PolicyValidationError, RequestShapeError
from policies.evaluate import compile_policy
from policies.jsonschema import schema_text
from policies.model import PolicyDocument
from policies.render import (
    DEFAULT_MAX_NUM_SEQS,
    batch_size_schedule,
    sglang_launch_args,
    trtllm_extra_options_yaml,
    vllm_serve_args,
)
from policies.shape import RequestShape
from policies.validate import load_policy


def _load(path: str) -> PolicyDocument:
    text = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    return load_policy(text)


def _cmd_validate(args: argparse.Namespace) -> int:
    status = 0
    for path in args.files:
        try:
            doc = _load(path)
        except PolicyValidationError as exc:
            status = 1
            print(f"{path}: invalid ({len(exc.errors)} error{'s' if len(exc.errors) != 1 else ''})",
                  file=sys.stderr)
            for err in exc.errors:
                print(f"  {err}", file=sys.stderr)
            continue
        print(f"{path}: ok  policy={doc.name} revision={revision_id(doc)}")
    return status


def _cmd_decide(args: argparse.Namespace) -> int:
    doc = _load(args.file)
    policy = compile_policy(doc, revision_id(doc))
    shapes: list[Any] = []
    for raw in args.shape:
        text = Path(raw[1:]).read_text() if raw.startswith("@") else raw
        value = json.loads(text)
        shapes.extend(value if isinstance(value, list) else [value])
    for data in shapes:
        decision = policy.decide(RequestShape.from_dict(data))
        print(json.dumps({"shape": data, "decision": decision.to_dict()}, sort_keys=True))
    return 0


def _cmd_canonical(args: argparse.Namespace) -> int:
    doc = _load(args.file)
    sys.stdout.write(canonical_json(canonical_document(doc)).decode() + "\n")
    print(revision_id(doc), file=sys.stderr)
    return 0


def _cmd_render(args: argparse.Namespace) -> int:
    doc = _load(args.file)
    seqs = args.max_num_seqs
    schedule = batch_size_schedule(doc, args.engine, seqs) if args.schedule else None
    if args.target == "vllm":
        rendered = vllm_serve_args(doc, args.engine, schedule=schedule, max_num_seqs=seqs)
        print(" ".join(_shell_quote(a) for a in rendered))
    elif args.target == "sglang":
        rendered, adaptive = sglang_launch_args(doc, args.engine, schedule=schedule, max_num_seqs=seqs,
                                                adaptive_config_path=args.adaptive_config)
        if adaptive is not None:
            Path(args.adaptive_config).write_text(json.dumps(adaptive, indent=2) + "\n")
        print(" ".join(_shell_quote(a) for a in rendered))
    else:
        sys.stdout.write(trtllm_extra_options_yaml(doc, args.engine, schedule=schedule, max_num_seqs=seqs))
    return 0


def _cmd_schema(args: argparse.Namespace) -> int:
    sys.stdout.write(schema_text())
    return 0


def _shell_quote(arg: str) -> str:
    return arg if arg.replace("-", "").replace("_", "").isalnum() else "'" + arg.replace("'", "'\\''") + "'"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m policies", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="validate documents; list every error with its path")
    p.add_argument("files", nargs="+")
    p.set_defaults(run=_cmd_validate)
    p = sub.add_parser("decide", help="evaluate request shapes (JSON, or @file) against a document")
    p.add_argument("file")
    p.add_argument("--shape", action="append", required=True)
    p.set_defaults(run=_cmd_decide)
    p = sub.add_parser("canonical", help="print the canonical JSON (revision id on stderr)")
    p.add_argument("file")
    p.set_defaults(run=_cmd_canonical)
    p = sub.add_parser("render", help="render an engine variant's configuration")
    p.add_argument("file")
    p.add_argument("--engine", required=True)
    p.add_argument("--target", choices=["vllm", "trtllm", "sglang"], default="vllm")
    p.add_argument("--schedule", action="store_true",
                   help="compile batch-size rules into the engine as well (always, for schedule: in_engine)")
    p.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS)
    p.add_argument("--adaptive-config", metavar="FILE",
                   help="sglang: where to write the adaptive config an engine that drafts by batch size needs")
    p.set_defaults(run=_cmd_render)
    p = sub.add_parser("schema", help="print the JSON Schema of a policy document (for editors)")
    p.set_defaults(run=_cmd_schema)
    args = parser.parse_args(argv)
    try:
        code: int = args.run(args)
        return code
    except PolicyValidationError as exc:
        for err in exc.errors:
            print(f"error: {err}", file=sys.stderr)
        return 1
    except RequestShapeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (OSError, json.JSONDecodeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
