"""Generation on split models: batches of mixed prompt lengths, sampling and stop tokens, against
the unsplit model (every step's logits), transformers' own generate, and an independent sampler.
The split side runs ``generate``'s default engine (the lean forward for Llama, the model's own for
GPT-2) and the model's own forward; the expected side always the model's own forward."""
import functools
import math

import numpy as np
import pytest
import torch

from tensorpar import distributed as dist
from tensorpar.models.sampling import Sampler, choose, gumbel
from tests import _generation_workers as W

ARCHS = ("llama", "gpt2")
# float64 split vs unsplit: the all-reduces add partial sums in another order than one matmul,
# so logits differ by rounding, ~1e-16 relative; 1e-10 is far above that and far below any fault.
LOGITS_TOL = 1e-10


@functools.lru_cache(maxsize=None)
def results() -> list:
    return dist.launch(W.generation_worker, 4, ARCHS, deadline=900)


@pytest.mark.parametrize("arch, tp", [(a, tp) for tp in (2, 4) for a in ARCHS])
def test_every_row_and_every_step_equal_the_unsplit_model(arch, tp):
    for rank, res in enumerate(results()):
        case = res[(arch, tp)]
        for name in W.SAMPLERS:
            c = case[name]
            assert c["tokens"] == c["dense_tokens"], (rank, name, c["tokens"], c["dense_tokens"])
            assert c["logits_err"] <= LOGITS_TOL, (rank, name, c["logits_err"])
            assert c["hf_engine_logits_err"] <= LOGITS_TOL, (rank, name, c["hf_engine_logits_err"])
            assert c["same_again"], (rank, name)
            # one exchange per step outside the model: the candidates, never a broadcast
            assert {op for op, _ in c["ops"]} == {"all_gather"}, c["ops"]
        greedy = case["greedy"]["tokens"]
        assert greedy == case["hf_batch"], ("left-padded batch differs from transformers", greedy, case["hf_batch"])
        assert greedy == [row[0] for row in case["hf_rows"]], "a row differs from the same prompt alone"
        assert case["tensor_and_mask"] == greedy, "input_ids with attention_mask differ from the lists"
        # llama's split model decodes through the lean forward by default; GPT-2 through its own
        assert (case["lean_why_not"] == "") == (arch == "llama"), case["lean_why_not"]


def test_the_cases_have_power():
    """Rows continue differently, sampled tokens differ from greedy ones, and the logits vary from
    step to step: equal tokens would otherwise prove nothing."""
    for key, case in results()[0].items():
        if key == "stop":
            continue
        arch = key[0]
        greedy = case["greedy"]["dense_tokens"]
        assert len({tuple(row) for row in greedy}) == len(greedy), (arch, greedy)
        assert any(len(set(row)) > 1 for row in greedy), (arch, greedy)
        assert case["temperature"]["dense_tokens"] != greedy, arch
        steps = case["greedy"]["dense_logits"]
        assert steps[0] != steps[1], arch


@pytest.mark.parametrize("name", [n for n in W.SAMPLERS if n != "greedy"])
def test_sampled_tokens_follow_an_independent_sampler(name):
    """The tokens chosen from each step's logits, recomputed here from the documented recipe
    (softmax over temperature-scaled logits, top-k, nucleus, Gumbel noise from the step's seed)
    without tensorpar's sampler."""
    kw = W.SAMPLERS[name]
    case = results()[0][("llama", 2)][name]
    for step, logits in enumerate(case["dense_logits"]):
        logits = torch.tensor(logits, dtype=torch.float64)  # (B, V)
        want = _reference_pick(logits, kw, step)
        assert [row[step] for row in case["dense_tokens"]] == want, (name, step)


def _reference_pick(logits, kw, step) -> list:
    b, v = logits.shape
    noise = -torch.log(-torch.log(torch.from_numpy(_documented_uniforms(kw["seed"], step, b, v))))
    picks = []
    for row in range(b):
        scores = [(x / kw.get("temperature", 1.0), i) for i, x in enumerate(logits[row].tolist())]
        order = sorted(scores, key=lambda s: (-s[0], s[1]))
        kept = order[: kw["top_k"]] if kw.get("top_k") else order
        top_p = kw.get("top_p", 1.0)
        if top_p < 1:
            biggest = kept[0][0]
            weights = [math.exp(s - biggest) for s, _ in kept]
            total, mass, nucleus = sum(weights), 0.0, []
            for (s, i), w in zip(kept, weights):
                if mass >= top_p:
                    break
                nucleus.append((s, i))
                mass += w / total
            kept = nucleus
        picks.append(max(kept, key=lambda s: (s[0] + noise[row, s[1]].item(), -s[1]))[1])
    return picks


@pytest.mark.parametrize("kw", [
    {"temperature": 1.0}, {"temperature": 0.5}, {"temperature": 2.0, "top_k": 3}, {"top_p": 0.7},
])
def test_draws_follow_the_distribution(kw):
    """6000 draws (steps) from fixed logits: each token's frequency within 5 standard errors of its
    probability (softmax over the kept tokens); a token outside top-k / top-p is never drawn."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3]], dtype=torch.float64)
    sampler = Sampler(do_sample=True, seed=5, **kw)
    v = logits.shape[1]
    n = 6000
    counts = torch.zeros(v)
    indices = torch.arange(v)[None]
    for step in range(n):
        counts[choose(logits, indices, sampler, step, v)] += 1
    probs = _expected(logits[0], kw)
    for token in range(v):
        p = probs[token]
        if p == 0:
            assert counts[token] == 0, (token, kw)
        else:
            sigma = math.sqrt(p * (1 - p) / n)
            assert abs(counts[token] / n - p) < 5 * sigma, (token, counts[token] / n, p, kw)


def _expected(logits, kw) -> list:
    scores = logits / kw.get("temperature", 1.0)
    order = sorted(range(len(scores)), key=lambda i: (-scores[i].item(), i))
    kept = order[: kw["top_k"]] if kw.get("top_k") else order
    weights = {i: math.exp(scores[i].item()) for i in kept}
    if kw.get("top_p", 1.0) < 1:
        total, mass, nucleus = sum(weights.values()), 0.0, []
        for i in kept:
            if mass >= kw["top_p"]:
                break
            nucleus.append(i)
            mass += weights[i] / total
        weights = {i: weights[i] for i in nucleus}
    total = sum(weights.values())
    return [weights.get(i, 0.0) / total for i in range(len(scores))]


def test_greedy_ties_go_to_the_smallest_index_like_argmax():
    values = torch.tensor([[1.0, 3.0, 3.0, 2.0]], dtype=torch.float64)
    indices = torch.tensor([[7, 4, 2, 9]])
    assert choose(values, indices, Sampler(), 0, 10).tolist() == [2]
    with pytest.raises(ValueError, match="contain NaN"):
        choose(torch.tensor([[float("nan"), 1.0]], dtype=torch.float64), torch.tensor([[0, 1]]), Sampler(), 0, 2)


def _documented_uniforms(seed, step, b, v):
    """The uniforms behind step ``step``'s noise, from tensorpar.models.sampling's docstring alone."""
    words = np.array([seed % 2 ** 32, seed // 2 ** 32, step % 2 ** 32, step // 2 ** 32], dtype=np.uint32)
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(words))).random((b, v))


def _stopped(free, stop, pad):
    """``free`` (rows generated without stopping) as stop token ``stop`` ends them, each padded with ``pad``."""
    stops_at = [row.index(stop) if stop in row else None for row in free]
    length = len(free[0]) if None in stops_at else max(stops_at) + 1  # ends once every row has stopped
    assert stops_at[0] >= 1 and stops_at[0] + 1 < length, (free, stop)  # row 0 stops, and is padded
    return [row[: k + 1] + [pad] * (length - k - 1) if k is not None else row[:length]
            for row, k in zip(free, stops_at)]


def test_a_stop_token_ends_its_row_and_pads_it():
    free, stop, got, _ = results()[0]["stop"]
    assert got == _stopped(free, stop, 0), (free, stop, got)


def test_a_stopped_row_is_padded_with_the_first_stop_token_by_default():
    """No pad_token_id: a stopped row continues with the first of its stop tokens (generate's
    docstring, the README's --pad-token-id), split (tp 2) and unsplit alike. The second stop token
    is one no row produces and the first is not 0: padding with 0, or with the last stop token,
    would differ."""
    free, stop, _, default = results()[0]["stop"]
    assert stop != 0
    for name, got in default.items():
        assert got == _stopped(free, stop, stop), (name, free, stop, got)


# Seeds torch's 32-bit seeding confuses (0 and 2**32, 1 and 2**32 + 1), neighbours, and large ones.
NOISE_SEEDS = (0, 1, 2, 3, 2 ** 32, 2 ** 32 + 1, 2 ** 62 + 12345, 2 ** 63 - 1)
NOISE_STEPS, NOISE_ROWS, NOISE_VOCAB = 16, 3, 50


def _noise() -> torch.Tensor:
    """(seeds, steps, rows, vocabulary) float64: the Gumbel noise of each seed's each step."""
    return torch.stack([torch.stack([gumbel(Sampler(do_sample=True, seed=s), t, NOISE_ROWS, NOISE_VOCAB)
                                     for t in range(NOISE_STEPS)]) for s in NOISE_SEEDS])


def test_sampling_noise_never_repeats_across_seeds_steps_and_rows():
    """19 200 noise values (8 seeds x 16 steps x 3 rows x 50 indices) hold no value twice. Noise
    reused between steps (a generator re-seeded with the seed alone), shifted (row b of step t + 1
    = row b + 1 of step t), shared between rows, or a key that collides ((seed 1, step 0) = (seed 0,
    step 1) under seed + step; seed 2**32 = seed 0 under torch's 32-bit seeding) repeats 50 values
    at once. Independent continuous draws rounded to float64 coincide with probability below
    N^2/2 * 2**-50 = 2e-7 (N = 19 200)."""
    values = _noise().flatten()
    assert values.unique().numel() == values.numel(), values.numel() - values.unique().numel()


def test_sampling_noise_is_uncorrelated_between_neighbouring_steps_seeds_and_rows():
    """Pearson correlation of the noise of neighbouring steps (t, t + 1), seeds (s, s + 1 in the
    list), rows (b, b + 1), and of the seed + step diagonal ((s + 1, t) against (s, t + 1)): each
    pools thousands of pairs, whose correlation is within 1/sqrt(n) of 0 for independent noise
    (one standard deviation); the bound is 6 of them (a false alarm below 2e-9 per check). Noise
    derived from another's (1 - U, a reused stream under a transform) correlates far beyond it."""
    g = _noise()  # (S, T, B, V)
    pairs = {"steps": (g[:, :-1], g[:, 1:]), "seeds": (g[:-1], g[1:]), "rows": (g[:, :, :-1], g[:, :, 1:]),
             "seed + step": (g[1:, :-1], g[:-1, 1:])}
    for name, (a, b) in pairs.items():
        r = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()
        assert abs(r) < 6 / math.sqrt(a.numel()), (name, r, a.numel())


def test_generate_refuses_what_it_cannot_run_before_any_step():
    """A text instead of token ids, a flat list of ids (one prompt needs its own list), a prompt
    plus max_new_tokens past the model's positions (GPT-2's table: an IndexError inside the
    forward; Llama's declared maximum): ValueError naming the values. At GPT-2's limit it runs."""
    from tensorpar.models.generation import generate
    from tensorpar.models.tiny import make_tiny_model
    for arch in ("gpt2", "llama"):
        model = make_tiny_model(arch, seed=1)  # 64 positions
        for args, message in (
                (("hello", 3), r"input_ids must be token ids, got a str \('hello'\): tokenize the text first"),
                (([1, 2, 3], 3), r"input_ids must be a list of token-id lists, one per prompt .* got \[1, 2, 3\]"),
                (([[1, 2], [3, 4, 5]], 62), r"the longest prompt \(3 tokens\) plus max_new_tokens \(62\) is 65 "
                                            r"tokens, more than this model's 64 positions"),
        ):
            with pytest.raises(ValueError, match=message):
                generate(model, *args)
    # left padding does not count: two real tokens plus 62 new ones fill GPT-2's 64 positions
    ids, mask = torch.tensor([[0, 0, 7, 8]]), torch.tensor([[0, 0, 1, 1]])
    assert generate(make_tiny_model("gpt2", seed=1), ids, 62, attention_mask=mask).shape == (1, 66)


# `tensorpar run` with prompt or stop ids a user mistypes: (argv, the words of the one line on
# stderr, exit 2, before any rank starts); "{llama}" is the tiny Llama checkpoint (130 tokens).
RUN_ID_ERRORS = [
    (["run", "--model", "{llama}", "--prompt-ids", "1,,2"],
     "--prompt-ids '1,,2' must be comma-separated integers, e.g. 1,2,3; item 2 is empty"),
    (["run", "--model", "{llama}", "--prompt-ids", ",1"], "--prompt-ids ',1' must be comma-separated integers"),
    (["run", "--model", "{llama}", "--prompt-ids", "1,"], "--prompt-ids '1,' must be comma-separated integers"),
    (["run", "--model", "{llama}", "--prompt-ids", "a"], "item 1 is 'a'"),
    (["run", "--model", "{llama}", "--prompt-ids", "1,-3"], "token ids must be a non-empty list of integers in "
                                                           "[0, 130); invalid: [-3]"),
    (["run", "--model", "{llama}", "--prompt-ids", "1,130"], "in [0, 130); invalid: [130]"),
    (["run", "--model", "{llama}", "--prompt-ids", "1,2", "--eos-token-id", "5,,6"],
     "--eos-token-id '5,,6' must be comma-separated integers, e.g. 1,2,3; item 2 is empty"),
    (["run", "--model", "{llama}", "--prompt-ids", "1,2", "--eos-token-id", ""], "--eos-token-id '' names no token"),
]


def test_mistyped_ids_are_one_line_with_exit_code_2(tmp_path):
    """Each case of RUN_ID_ERRORS through the command line's entry (tests._cli_batch, in this
    process): exit 2, one line on stderr with its words, nothing on stdout. `1,,2` was read as `1,2`."""
    from tensorpar.models.tiny import make_tiny_checkpoint
    from tests._cli_batch import run_all
    llama = make_tiny_checkpoint(tmp_path / "llama", "llama")
    runs = run_all([[a.format(llama=llama) for a in args] for args, _ in RUN_ID_ERRORS])
    for (args, words), run in zip(RUN_ID_ERRORS, runs):
        lines = [ln for ln in run["stderr"].splitlines() if ln.strip()]
        assert run["rc"] == 2 and len(lines) == 1 and words in lines[0] and run["stdout"] == "", (args, run)
