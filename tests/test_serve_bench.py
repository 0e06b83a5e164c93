"""The serve benchmark's arithmetic (tensorpar/bench/serve.py), on made-up times: what a figure
in bench/out/serve.md means is what these say (no server runs here)."""
import math

from tensorpar.bench.serve import figures, generate_figures, serve_page, serve_table, summarize, workload


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
           "vs_sequential_generate": 18.77, "vs_hf_cb": 4.5, "ttft_p50_s": 0.2463, "ttft_p99_s": 0.5611,
           "tpot_p50_s": 0.1096, "tpot_p99_s": 0.319}
    base = {**row, "server": "generate", "streams": 1, "ttft_p50_s": math.nan, "ttft_p99_s": None}
    del base["vs_hf_cb"]
    lines = serve_table([base, row]).splitlines()
    assert lines[3] == "| tensorpar | 32 | 64 | 2621 | 147.9 | 18.77 | 4.50 | 246.3 / 561.1 | 109.6 / 319.0 |"
    assert lines[2].endswith("| 18.77 | - | - | 109.6 / 319.0 |")  # generate's row: no TTFT, no HF ratio


def _fig(tps, ttft=0.1, tokens=100):
    return {"requests": 4, "tokens": tokens, "tokens_per_s": tps, "ttft_p50_s": ttft, "ttft_p99_s": 2 * ttft,
            "tpot_p50_s": 0.01, "tpot_p99_s": 0.02}


def test_rounds_give_medians_and_ratios_paired_within_a_round():
    # round 2 ran on a machine twice as slow for everybody: a paired ratio does not see it, a
    # quotient of medians would (tensorpar's median 40 / generate's median 10 = 4, not 5)
    samples = {("generate", 1): [generate_figures([(0.0, 1.0, 10), (5.0, 6.0, 10)]),  # 10 tok/s
                                 generate_figures([(0.0, 4.0, 20)]),  # 5
                                 generate_figures([(0.0, 0.5, 6)])],  # 12
               ("tensorpar", 32): [_fig(50.0), _fig(25.0, ttft=0.3), _fig(40.0)],
               ("hf_cb", 32): [_fig(25.0), _fig(5.0), _fig(20.0)]}
    rows = {(r["server"], r["streams"]): r for r in summarize(samples, one_s=1.5)}
    gen, ours, hf = rows[("generate", 1)], rows[("tensorpar", 32)], rows[("hf_cb", 32)]
    assert gen["tokens_per_s"] == 10.0 and gen["tokens"] == 20 and gen["vs_sequential_generate"] == 1.0
    assert math.isnan(gen["ttft_p50_s"]) and gen["tpot_p50_s"] == 0.1  # median of 0.1 s a token per request
    assert ours["tokens_per_s"] == 40.0 and ours["ttft_p50_s"] == 0.1 and ours["ttft_p99_s"] == 0.2
    assert ours["vs_sequential_generate"] == 5.0  # median of 50/10, 25/5, 40/12
    assert ours["vs_hf_cb"] == 2.0 and "vs_hf_cb" not in hf  # median of 2, 5, 2
    assert ours["rounds"] == 3 and len(ours["samples"]) == 3 and ours["mean_request_alone_s"] == 1.5


def test_the_page_names_its_command_and_judges_the_targets():
    samples = {("generate", 1): [generate_figures([(0.0, 1.0, 10)])] * 3,
               ("tensorpar", 8): [_fig(30.0)] * 3, ("tensorpar", 32): [_fig(45.0)] * 3,
               ("hf_cb", 8): [_fig(40.0)] * 3, ("hf_cb", 32): [_fig(20.0)] * 3}
    page = serve_page(summarize(samples, one_s=1.0), "tensorpar bench --suite serve")
    assert "Written by `tensorpar bench --suite serve` at " in page and "3 interleaved rounds" in page
    assert "- 32 streams: at least 4x sequential generate: met" in page  # 4.5x
    assert "- ahead of HF's continuous batching at every load: missed at 1 of 2 loads" in page  # 0.75x at 8
    quick = {k: v for k, v in samples.items() if k[1] != 32}
    assert "at least 4x sequential generate: not measured in this run" in serve_page(summarize(quick, 1.0), "x")
