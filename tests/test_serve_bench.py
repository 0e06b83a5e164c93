"""The serve benchmark's arithmetic (tensorpar/bench/serve.py), on made-up times: what a figure
in bench/out/serve.md means is what these say (no server runs here)."""
import math

from tensorpar.bench.serve import figures, serve_table, workload


def test_figures_from_token_times():
    # request 0 arrives at 0, tokens at 1, 2, 4; request 1 arrives at 1, tokens at 3, 4; one never answered
    got = figures([0.0, 1.0, 2.0], [[1.0, 2.0, 4.0], [3.0, 4.0], []])
    assert got["tokens"] == 5 and got["requests"] == 3
    assert got["tokens_per_s"] == 5 / 4  # first arrival to last token
    assert (got["ttft_p50_s"], got["ttft_p99_s"]) == (1.0, 2.0)  # arrival to first token: 1 and 2
    assert (got["tpot_p50_s"], got["tpot_p99_s"]) == (1.0, 2.0)  # gaps 1, 2 (request 0) and 1 (request 1)


def test_the_load_is_open_loop_and_mixed():
    reqs = workload(400, rate=20.0, seed=1, vocab=100, prompts=(8, 96), outputs=(16, 64))
    assert reqs == workload(400, rate=20.0, seed=1, vocab=100, prompts=(8, 96), outputs=(16, 64))
    gaps = [b.at - a.at for a, b in zip(reqs, reqs[1:])]
    assert all(g >= 0 for g in gaps) and abs(sum(gaps) / len(gaps) - 1 / 20) < 0.01  # Poisson at 20/s
    assert {len(r.prompt) for r in reqs} <= set(range(8, 97)) and len({len(r.prompt) for r in reqs}) > 40
    assert {r.max_tokens for r in reqs} <= set(range(16, 65)) and len({r.max_tokens for r in reqs}) > 30
    assert all(3 <= t < 100 for r in reqs for t in r.prompt)


def test_the_table_says_each_row():
    row = {"server": "tensorpar", "streams": 32, "requests": 64, "tokens": 2621, "tokens_per_s": 147.9,
           "vs_sequential_generate": 18.77, "ttft_p50_s": 0.2463, "ttft_p99_s": 0.5611, "tpot_p50_s": 0.1096,
           "tpot_p99_s": 0.319}
    base = {**row, "server": "generate", "streams": 1, "ttft_p50_s": math.nan, "ttft_p99_s": None}
    lines = serve_table([base, row]).splitlines()
    assert lines[3] == "| tensorpar | 32 | 64 | 2621 | 147.9 | 18.77 | 246.3 / 561.1 | 109.6 / 319.0 |"
    assert lines[2].endswith("| 18.77 | - | 109.6 / 319.0 |")  # generate's row: no TTFT of its own
