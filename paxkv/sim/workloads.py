"""Synthetic request traces shaped like the PagedAttention paper's workloads (host only).

The paper samples requests from ShareGPT (mean 161 input / 338 output tokens) and Alpaca
(mean 19 input / 58 output). Those datasets are not shipped here, so a trace is drawn from
lognormal length distributions fitted to the published means: the experiments then measure
the same effects (internal fragmentation, reservation waste, batch size) on lengths with the
same scale and a realistic long tail, from a seed, with nothing to download.

The fit. A length is `clip(rint(X), 1, max_len)` with `X ~ LogNormal(mu, sigma)`. `sigma`
(the spread) is chosen by hand, `mu` is then solved by bisection so that the mean of the
*rounded and clipped* distribution equals the target exactly (computed from the lognormal
CDF, not by sampling), so clipping the long tail does not pull the mean off target.

| workload | part   | target mean | sigma | clip          | why this spread                       |
| -------- | ------ | ----------- | ----- | ------------- | ------------------------------------- |
| ShareGPT | input  | 161         | 1.2   | [1, 1024]     | chat turns: short questions, long pasted texts |
| ShareGPT | output | 338         | 0.9   | [1, 1024]     | long answers, a few hit the length cap |
| Alpaca   | input  | 19          | 0.6   | [1, 1024]     | one-line instructions                  |
| Alpaca   | output | 58          | 0.9   | [1, 1024]     | short answers, some lists/paragraphs   |
| translation | input / output | 30 / 30 | 0.5 | [1, 1024]  | one news sentence each way (assumed)   |

`chatbot_like` builds conversation histories from the ShareGPT-like turns, cut to a prompt
length; `translation_like` gives the per-request part of the shared-prefix workload.

With both caps at 1024, prompt + output never exceeds 2048, the context of the paper's OPT
models and the default `max_model_len` of the experiments.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Request:
    """One synthetic request: how long its prompt is, how many tokens it will generate, when it comes."""

    prompt_len: int
    output_len: int
    arrival_time: float = 0.0


@dataclasses.dataclass(frozen=True)
class LengthDist:
    """A fitted length distribution: `clip(rint(LogNormal(mu, sigma)), 1, max_len)`."""

    mean: float
    sigma: float
    max_len: int

    @functools.cached_property
    def mu(self) -> float:
        return _fit_mu(self.mean, self.sigma, self.max_len)

    def sample(self, rng: np.random.Generator, num: int) -> np.ndarray:
        x = rng.lognormal(self.mu, self.sigma, size=num)
        return np.clip(np.rint(x), 1, self.max_len).astype(np.int64)

    def expected_mean(self) -> float:
        return _clipped_rounded_mean(self.mu, self.sigma, self.max_len)


SHAREGPT_INPUT = LengthDist(mean=161.0, sigma=1.2, max_len=1024)
SHAREGPT_OUTPUT = LengthDist(mean=338.0, sigma=0.9, max_len=1024)
ALPACA_INPUT = LengthDist(mean=19.0, sigma=0.6, max_len=1024)
ALPACA_OUTPUT = LengthDist(mean=58.0, sigma=0.9, max_len=1024)

TRACES = ("sharegpt", "alpaca", "translation")

# Translation sentences (the paper's shared-prefix workload translates WMT16 English to German;
# it gives the prefixes' lengths, 80 and 341 tokens, but not the sentences'). About 30 tokens
# each way is our assumption for news sentences of about 23 words; a German translation runs
# about as long as its source.
TRANSLATION_INPUT = LengthDist(mean=30.0, sigma=0.5, max_len=1024)
TRANSLATION_OUTPUT = LengthDist(mean=30.0, sigma=0.5, max_len=1024)


def _lognormal_cdf(x: float, mu: float, sigma: float) -> float:
    if x <= 0.0:
        return 0.0
    return 0.5 * (1.0 + math.erf((math.log(x) - mu) / (sigma * math.sqrt(2.0))))


def _clipped_rounded_mean(mu: float, sigma: float, max_len: int) -> float:
    """E[clip(rint(X), 1, max_len)] for X ~ LogNormal(mu, sigma), exactly (up to float error)."""
    # rint(X) == k  <=>  k - 0.5 <= X < k + 0.5; every mass below 1.5 lands on 1,
    # every mass above max_len - 0.5 on max_len.
    cdf = [_lognormal_cdf(k + 0.5, mu, sigma) for k in range(1, max_len)]
    mean, prev = 1.0 * cdf[0], cdf[0]
    for k in range(2, max_len):
        c = cdf[k - 1]
        mean += k * (c - prev)
        prev = c
    return mean + max_len * (1.0 - prev)


@functools.lru_cache(maxsize=None)
def _fit_mu(mean: float, sigma: float, max_len: int) -> float:
    """The mu whose rounded, clipped lognormal has the target mean (bisection on a monotone map)."""
    if not 1.0 <= mean < max_len:
        raise ValueError(f"mean must be in [1, max_len={max_len}), got {mean}")
    if sigma <= 0:
        raise ValueError(f"sigma must be positive, got {sigma}")
    lo, hi = -10.0, math.log(max_len) + 10.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if _clipped_rounded_mean(mid, sigma, max_len) < mean:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _check_num(num: int) -> None:
    if not isinstance(num, (int, np.integer)) or num < 0:
        raise ValueError(f"num must be a non-negative integer, got {num!r}")


def poisson_arrivals(num: int, rate: float, seed: int) -> np.ndarray:
    """Arrival times (seconds, from 0) of a Poisson process of `rate` requests/s.

    `rate=inf` means every request is there at time 0 (the offline/batch setting).
    """
    _check_num(num)
    if not rate > 0:
        raise ValueError(f"rate must be positive (requests/s), got {rate}")
    if math.isinf(rate):
        return np.zeros(num)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num)
    return np.cumsum(gaps) - gaps[0] if num else gaps  # first request at t=0


def _trace(inputs: LengthDist, outputs: LengthDist, num: int, seed: int,
           rate: float) -> list[Request]:
    _check_num(num)
    # Independent streams for lengths and arrivals: changing the rate keeps the lengths.
    len_seed, arr_seed = np.random.SeedSequence(seed).spawn(2)
    rng = np.random.default_rng(len_seed)
    prompt = inputs.sample(rng, num)
    output = outputs.sample(rng, num)
    times = poisson_arrivals(num, rate, int(arr_seed.generate_state(1)[0]))
    return [Request(int(p), int(o), float(t)) for p, o, t in zip(prompt, output, times)]


def sharegpt_like(num: int, seed: int = 0, rate: float = math.inf) -> list[Request]:
    """`num` requests with ShareGPT-like lengths (mean 161 in / 338 out), Poisson arrivals at `rate`."""
    return _trace(SHAREGPT_INPUT, SHAREGPT_OUTPUT, num, seed, rate)


def alpaca_like(num: int, seed: int = 0, rate: float = math.inf) -> list[Request]:
    """`num` requests with Alpaca-like lengths (mean 19 in / 58 out), Poisson arrivals at `rate`."""
    return _trace(ALPACA_INPUT, ALPACA_OUTPUT, num, seed, rate)


def fixed(num: int, input_len: int, output_len: int, seed: int = 0,
          rate: float = math.inf) -> list[Request]:
    """`num` identical requests (e.g. 256 in / 256 out, the vLLM throughput benchmark's setting)."""
    _check_num(num)
    if input_len < 1:
        raise ValueError(f"input_len must be >= 1, got {input_len}")
    if output_len < 1:
        raise ValueError(f"output_len must be >= 1, got {output_len}")
    times = poisson_arrivals(num, rate, seed)
    return [Request(input_len, output_len, float(t)) for t in times]


def translation_like(num: int, seed: int = 0, rate: float = math.inf) -> list[Request]:
    """`num` sentences to translate (about 30 tokens in, 30 out); the caller prepends the shared
    few-shot prefix, so `prompt_len` is the sentence's own part."""
    return _trace(TRANSLATION_INPUT, TRANSLATION_OUTPUT, num, seed, rate)


def chatbot_like(num: int, seed: int = 0, rate: float = math.inf, max_prompt_len: int = 1024,
                 mean_prior_turns: float = 2.0) -> list[Request]:
    """`num` chatbot requests: the conversation so far plus the new question is the prompt.

    A conversation has a geometric number of earlier turns (mean `mean_prior_turns`), each a
    ShareGPT-like question and answer; the prompt is that history and the new ShareGPT-like
    question, keeping its last `max_prompt_len` tokens (the paper keeps the last 1,024 for a
    2,048-token model). The answer is ShareGPT-like. So prompts are long, mostly at the cut,
    and answers short beside them.
    """
    _check_num(num)
    if max_prompt_len < 1:
        raise ValueError(f"max_prompt_len must be >= 1, got {max_prompt_len}")
    if mean_prior_turns < 0:
        raise ValueError(f"mean_prior_turns must be >= 0, got {mean_prior_turns}")
    len_seed, arr_seed = np.random.SeedSequence(seed).spawn(2)
    rng = np.random.default_rng(len_seed)
    turns = rng.geometric(1.0 / (1.0 + mean_prior_turns), size=num) - 1
    prompts = []
    for k in turns:
        history = SHAREGPT_INPUT.sample(rng, int(k)).sum() + SHAREGPT_OUTPUT.sample(rng, int(k)).sum()
        query = SHAREGPT_INPUT.sample(rng, 1)[0]
        prompts.append(int(min(history + query, max_prompt_len)))
    output = SHAREGPT_OUTPUT.sample(rng, num)
    times = poisson_arrivals(num, rate, int(arr_seed.generate_state(1)[0]))
    return [Request(p, int(o), float(t)) for p, o, t in zip(prompts, output, times)]


def make_trace(name: str, num: int, seed: int = 0, rate: float = math.inf) -> list[Request]:
    """A trace by name ("sharegpt", "alpaca" or "translation"), for flag-driven experiments."""
    if name == "sharegpt":
        return sharegpt_like(num, seed, rate)
    if name == "alpaca":
        return alpaca_like(num, seed, rate)
    if name == "translation":
        return translation_like(num, seed, rate)
    raise ValueError(f"trace must be one of {TRACES}, got {name!r}")


def random_token_requests(trace: list[Request], vocab_size: int, max_model_len: int,
                          seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output tokens) of each request, for the benchmarks that send token ids.

    Ids are uniform in [10, vocab_size - 10), away from the special ids. A prompt keeps at most
    max_model_len - 2 tokens and its output what then fits below max_model_len - 1 (at least
    one token), so that every request fits the engine whatever the trace drew."""
    rng = np.random.default_rng(seed)
    cap = max_model_len - 1
    out = []
    for r in trace:
        prompt_len = min(r.prompt_len, cap - 1)
        output_len = max(1, min(r.output_len, cap - prompt_len))
        out.append((rng.integers(10, vocab_size - 10, size=prompt_len).tolist(), output_len))
    return out


def summarize(requests: list[Request]) -> dict[str, float]:
    """Means and percentiles of a trace, for result files."""
    p = np.array([r.prompt_len for r in requests], dtype=np.float64)
    o = np.array([r.output_len for r in requests], dtype=np.float64)
    if not len(p):
        return {"num": 0}
    return {
        "num": len(p),
        "prompt_mean": float(p.mean()), "prompt_p50": float(np.median(p)),
        "prompt_p99": float(np.percentile(p, 99)), "prompt_max": float(p.max()),
        "output_mean": float(o.mean()), "output_p50": float(np.median(o)),
        "output_p99": float(np.percentile(o, 99)), "output_max": float(o.max()),
    }
