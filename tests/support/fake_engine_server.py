"""A FAKE vLLM server process for the engine supervisor's tests: ``python -m tests.support.fake_engine_server``.

It is not vLLM. It reads the arguments the supervisor gives a vLLM server (``--model``, ``--host``,
``--port``, ``--speculative-config``; others are accepted and ignored), takes ``FAKE_ENGINE_START_DELAY_S``
(default 0.3) to come up as a real server takes a while, then serves a
:class:`tests.support.fake_upstream.FakeEngine` whose answers' text is the speculative config it was started
with (``{}`` without one), so a test sees which arguments answered. Each token takes
``FAKE_ENGINE_TOKEN_DELAY_S`` (default 0.02). Like vLLM it refuses to start, exit 1, when the
speculative config names a draft model path that does not exist. Unlike vLLM, SIGTERM ends it at once,
cutting off answers in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path

from tests.support.fake_upstream import FakeEngine


def main() -> int:
    parser = argparse.ArgumentParser(prog="fake_engine_server")
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--speculative-config", default=None)
    args, _ = parser.parse_known_args()
    spec = json.loads(args.speculative_config) if args.speculative_config else {}
    draft = spec.get("model")
    if isinstance(draft, str) and not Path(draft).exists():
        print(f"FAKE engine: draft model {draft!r} not found", file=sys.stderr)
        return 1

    async def serve() -> None:
        await asyncio.sleep(float(os.environ.get("FAKE_ENGINE_START_DELAY_S", "0.3")))
        engine = FakeEngine(Path(args.model).name, speculative=bool(spec))
        engine.port = args.port
        engine.content = json.dumps(spec, sort_keys=True)
        engine.token_delay = float(os.environ.get("FAKE_ENGINE_TOKEN_DELAY_S", "0.02"))
        await engine.start()
        print(f"FAKE engine up on {args.host}:{args.port} with {engine.content}", flush=True)
        # SIGTERM ends it at once, answers in flight cut off: a test then sees whether the supervisor drained
        # the engine before stopping it (a real server's graceful shutdown would hide that).
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        await asyncio.Event().wait()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
