"""Engine supervision with real vLLM CPU engines: ``python -m bench.supervise``.

The sidecar's engine supervisor (sidecar/supervisor.py) runs the testbed's plain and draft-model engines
from a supervise configuration and the testbed policy, then applies two new policies while a client keeps
asking the plain engine: one that changes the draft engine's K (3 to 2: drain, restart, health, resume), and
one naming a draft model this worker does not have (vLLM refuses to start: back on the previous arguments).
Reported: how long the engines took to come up, each restart's duration and outcome, the plain engine's
answers meanwhile (and how many failed), and whether the running draft server's command line carries the
new K. It stops the engines when done.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

TESTBED_POLICY = Path(__file__).resolve().parent.parent / "policies" / "examples" / "testbed.yaml"


def policy_variant(k: int | None = None, draft_model: str | None = None) -> Any:
    from policies import load_policy

    text = TESTBED_POLICY.read_text()
    if k is not None:
        text = text.replace("    num_speculative_tokens: 3\n", f"    num_speculative_tokens: {k}\n")
    if draft_model is not None:
        text = text.replace("model: testbed/draft", f"model: {draft_model}")
    return load_policy(text)


def supervise_config(base_port: int, log_dir: Path) -> Any:
    from sidecar.supervisor import SuperviseConfig
    from testbed import engines
    from testbed.models import ensure

    testbed = ensure(quiet=False)
    common = ["--served-model-name", engines.MODEL_NAME, "--dtype", "float32", "--max-model-len", "1024",
              "--seed", "0"]
    offline = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return SuperviseConfig.model_validate({
        "command": [str(testbed.python), "-m", "vllm.entrypoints.openai.api_server"],
        # each engine its own compile cache, as the testbed gives them: an engine stopped while it compiles
        # can leave the cache's lock held, and a restart on the same cache then waits for it
        "engines": {name: {"model": str(testbed.models.target), "port": base_port + i,
                           "env": {**engines.cpu_binding(name), **offline, **engines.compile_cache(name)},
                           "args": common}
                    for i, name in enumerate(("base", "draft"))},
        "models": {"testbed/draft": str(testbed.models.draft)},
        "start_timeout_s": 900, "log_dir": str(log_dir)})


async def run(base_port: int, log_dir: Path) -> dict[str, Any]:
    import httpx

    from sidecar.replicas import InFlight, Pools
    from sidecar.supervisor import EngineSupervisor
    from testbed import engines

    config = supervise_config(base_port, log_dir)
    pools = Pools({name: [config.url(name)] for name in config.engines}, inflight=InFlight())
    supervisor = EngineSupervisor(config, pools, log_dir)
    report: dict[str, Any] = {"log_dir": str(log_dir)}
    t0 = time.monotonic()
    supervisor.start(policy_variant())
    while not all(r["state"] in ("serving", "failed") for r in supervisor.report()):
        await asyncio.sleep(0.5)
    report["start_s"] = round(time.monotonic() - t0, 1)
    report["started"] = supervisor.report()
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            async def ask(name: str) -> int:
                try:
                    answer = await client.post(config.url(name) + "/v1/completions", json={
                        "model": engines.MODEL_NAME, "prompt": "the cat", "max_tokens": 8, "temperature": 0})
                except httpx.HTTPError:
                    return 0
                return answer.status_code

            codes: list[int] = []
            stop = asyncio.Event()

            async def plain_traffic() -> None:
                while not stop.is_set():
                    codes.append(await ask("base"))
                    await asyncio.sleep(0.05)

            traffic = asyncio.create_task(plain_traffic())
            for label, doc in (("k_3_to_2", policy_variant(k=2)),
                               ("missing_draft_model", policy_variant(k=2, draft_model="testbed/missing-draft"))):
                t0 = time.monotonic()
                await supervisor.apply(doc)
                report[label] = {"seconds": round(time.monotonic() - t0, 1), **supervisor.engines["draft"].report()}
                print(f"{label}: {report[label]}", flush=True)
            stop.set()
            await traffic
            report["plain_answers_meanwhile"] = len(codes)
            report["plain_failures_meanwhile"] = sum(code != 200 for code in codes)
            report["draft_answers_after"] = await ask("draft")
            pid = supervisor.engines["draft"].process.pid if supervisor.engines["draft"].process else None
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode() if pid else ""
            report["draft_command_line_has_k_2"] = '"num_speculative_tokens":2' in cmdline
    finally:
        await supervisor.stop()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.supervise", description=__doc__.split("\n")[0])
    parser.add_argument("--base-port", type=int, default=18850, help="the plain engine's port; draft's is +1")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="specgate-bench-supervise-") as tmp:
        report = asyncio.run(run(args.base_port, Path(tmp)))
    print(json.dumps({k: v for k, v in report.items() if k != "started"}, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
