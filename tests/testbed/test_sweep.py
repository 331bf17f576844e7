"""The sweep's arithmetic and report, on made-up engine responses."""

from __future__ import annotations

from typing import Any

from testbed import sweep


def _response(tokens: int, itl: float, ttft: float, drafted: int = 0, accepted: int = 0,
              steps: int = 0) -> dict[str, Any]:
    metrics: dict[str, Any] = {"mean_itl_ms": itl, "time_to_first_token_ms": ttft}
    if drafted:
        metrics["speculative_decoding"] = {"num_draft_tokens": drafted, "num_accepted_draft_tokens": accepted,
                                           "num_spec_steps": steps}
    return {"usage": {"completion_tokens": tokens}, "metrics": metrics}


def test_summarize_uses_the_engines_own_metrics() -> None:
    cell = sweep.summarize([_response(10, 2.0, 5.0, 8, 6, 2), _response(30, 4.0, 7.0, 4, 1, 1)], wall_s=2.0)
    assert cell["output_tokens"] == 40
    assert cell["tokens_per_s"] == 20.0
    assert cell["mean_itl_ms"] == 3.0
    assert cell["ttft_ms"] == 6.0
    assert cell["acceptance"] == round(7 / 12, 4)
    assert cell["mean_acceptance_length"] == round(1 + 7 / 3, 3)
    # 1 request/s, each (6 + 3 x 19) ms inside the engine
    assert cell["engine_occupancy"] == 0.06


def test_summarize_without_speculation() -> None:
    cell = sweep.summarize([_response(5, 1.0, 1.0)], wall_s=1.0, errors=1)
    assert cell["acceptance"] is None
    assert cell["errors"] == 1


def test_crossover() -> None:
    assert sweep.crossover([(1, 1.5), (2, 1.2), (4, 0.9), (8, 0.7)]) == \
        "pays at 1, 2; loses at 4, 8 (crossover between 2 and 4)"
    assert sweep.crossover([(1, 1.5), (2, 1.2)]) == "pays at every load (1, 2)"
    assert sweep.crossover([(1, 0.5), (2, 0.9)]) == "never pays (1, 2)"
    assert sweep.crossover([(1, 1.1), (2, 0.9), (4, 1.2)]) == "pays at 1, 4; loses at 2 (no clean crossover)"
    assert sweep.crossover([(1, None)]) == "-"


def test_markdown_tables() -> None:
    http = [{"variant": v, "route": "chat", "concurrency": c, "mean_itl_ms": itl, "tokens_per_s": 100.0,
             "ttft_ms": 5.0, "acceptance": None if v == "base" else 0.5}
            for v, c, itl in [("base", 1, 4.0), ("ngram", 1, 2.0), ("base", 16, 4.0), ("ngram", 16, 8.0)]]
    offline = [{"variant": v, "route": "chat", "batch": b, "tokens_per_s": tps, "acceptance": None}
               for v, b, tps in [("base", 1, 100.0), ("ngram", 1, 250.0), ("base", 32, 1000.0), ("ngram", 32, 900.0)]]
    text = sweep.markdown({"http": http, "offline": offline})
    assert "| chat | 1 | 4.00 | 2.00 | 2.00 |" in text
    assert "- chat / ngram: pays at 1; loses at 16 (crossover between 1 and 16)" in text
    assert "| chat | 32 | 1000 | 900 | 0.90 |" in text
    assert "- chat / ngram: pays at 1; loses at 32 (crossover between 1 and 32)" in text


def test_http_sweep_against_a_fake_openai_server() -> None:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "bench.fake_openai", "--port", "0", "--tokens", "5"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line[0] == "READY"
        rows = sweep.http_sweep(f"http://127.0.0.1:{line[1]}", "base", ["chat", "extract"], [1, 3], per_cell=4,
                                max_tokens=8, seed=1)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert [(r["route"], r["concurrency"], r["requests"]) for r in rows] == [
        ("chat", 1, 4), ("chat", 3, 6), ("extract", 1, 4), ("extract", 3, 6)]
    assert all(r["errors"] == 0 and r["output_tokens"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert all(r["engine_occupancy"] is not None and r["engine_occupancy"] > 0 for r in rows), rows
    assert "### HTTP" in sweep.markdown({"http": rows})
