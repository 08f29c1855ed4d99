"""Requests for the server tier: prompts from local real text, sent concurrently, summarised.

Prompts are function openings from this interpreter's standard library sources (the text
the trained tiny models saw; deterministic: sorted files, a fixed stride). Results carry
SGLang's own per-request ``meta_info`` (``spec_num_correct_drafts``, ``spec_verify_ct``),
which at ``max_new_tokens = 2`` describes exactly one verify: the first.
"""

from __future__ import annotations

import itertools
import math
import random
import sysconfig
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pd_middleware.evaluation.live_ab import parse_prometheus
from pd_middleware.evaluation.stats import two_sample_tv_test

from .harness import Server, get_text, metric_values, post_json, post_pd


def prompts(n: int, *, offset: int = 0) -> list[str]:
    """``n`` distinct prompts: a ``def`` line and the two after it, from stdlib files.

    Every opening of the sorted top-level stdlib modules is a candidate; prompt i is
    candidate ``offset + 3 * i`` (so different ``offset`` values give mostly other prompts).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    cands: list[str] = []
    seen: set[str] = set()
    for path in sorted(root.glob("*.py")):
        lines = path.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if line.startswith("def ") and len(line) < 80:
                text = "\n".join(lines[i : i + 3])[:200]
                if text not in seen:
                    seen.add(text)
                    cands.append(text)
        if len(cands) > offset + 3 * n:
            break
    out = cands[offset::3][:n]
    if len(out) < n:
        raise RuntimeError(f"only {len(out)} prompts found under {root}, {n} asked")
    return out


@dataclass(frozen=True)
class Result:
    status: int
    output_ids: tuple[int, ...]
    correct_drafts: int | None
    verify_ct: int | None
    accept_length: float | None
    error: str = ""
    #: per output token, SGLang's top logprobs as (logprob, token id), best first (asked with
    #: ``top_logprobs``; empty otherwise)
    top_logprobs: tuple[tuple[tuple[float, int], ...], ...] = ()


def _result(status: int, body: Any) -> Result:
    if status != 200 or not isinstance(body, dict):
        return Result(status, (), None, None, None, str(body)[:500])
    m = body.get("meta_info", {})
    top = tuple(tuple((float(e[0]), int(e[1])) for e in row) for row in m.get("output_top_logprobs") or ())
    return Result(
        status,
        tuple(body.get("output_ids", ())),
        m.get("spec_num_correct_drafts"),
        m.get("spec_verify_ct"),
        m.get("spec_accept_length"),
        top_logprobs=top,
    )


def _body(text: str, params: dict[str, Any], top_logprobs: int) -> dict[str, Any]:
    body: dict[str, Any] = {"text": text, "sampling_params": params}
    if top_logprobs:
        body.update(return_logprob=True, top_logprobs_num=top_logprobs)
    return body


def _params(temperature: float, max_new_tokens: int, seed: int | None, i: int) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": temperature, "ignore_eos": True}
    if seed is not None:
        params["sampling_seed"] = seed + i
    return params


def generate(
    url: str,
    texts: Sequence[str],
    *,
    temperature: float,
    max_new_tokens: int,
    concurrency: int = 8,
    seed: int | None = None,
    timeout_s: float = 600.0,
    top_logprobs: int = 0,
) -> list[Result]:
    """POST ``/generate`` for every text (``concurrency`` at a time, each bounded by its timeout);
    ``top_logprobs``: that many top logprobs per output token in each result."""

    def one(i: int) -> Result:
        body = _body(texts[i], _params(temperature, max_new_tokens, seed, i), top_logprobs)
        return _result(*post_json(url + "/generate", body, timeout_s=timeout_s))

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(len(texts))))


_ROOMS = itertools.count(random.Random().randrange(1 << 40) << 16)


def generate_pd(
    prefill: Server,
    decode: Server,
    texts: Sequence[str],
    *,
    temperature: float,
    max_new_tokens: int,
    concurrency: int = 8,
    timeout_s: float = 300.0,
) -> list[Result]:
    """As :func:`generate`, through a prefill and a decode without a router (:func:`harness.post_pd`,
    a fresh bootstrap room per request): one prefill can then serve several decodes. The
    decode's answer is the result; a request whose prefill answer is not 200 fails with it."""

    def one(i: int) -> Result:
        body = _body(texts[i], _params(temperature, max_new_tokens, None, i), 0)
        (ps, pb), (ds, db) = post_pd(prefill, decode, body, next(_ROOMS), timeout_s=timeout_s)
        if ps != 200:
            return Result(ps, (), None, None, None, f"prefill: {str(pb)[:500]}")
        return _result(ds, db)

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(len(texts))))


#: A greedy pick whose two best logits are this close (nats) is a tie within bf16 noise: the
#: tiny models' bf16 logits step by 1/32 near their peaks, and a verify batch of another
#: shape (other drafts, another TP layout) moves a logit by a step or two.
GREEDY_TIE_NATS = 0.1


def greedy_mismatches(got: Sequence[Result], ref: Sequence[Result], *, tie_nats: float = GREEDY_TIE_NATS) -> list[str]:
    """Greedy outputs that differ from the reference's other than at a near-tie.

    ``ref`` carries top logprobs (``generate(..., top_logprobs=2)``). Each output must equal
    its reference, or first differ at a position where it took the reference's runner-up
    and the reference's two best were within ``tie_nats``: greedy decoding in bf16 is
    exact only up to such ties, whatever the proposal (from there on the texts diverge).
    Returns one line per output that breaks this (empty: all agree)."""
    bad = []
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        j = next((k for k, (a, b) in enumerate(zip(g.output_ids, r.output_ids)) if a != b), None)
        if j is None:
            if len(g.output_ids) != len(r.output_ids):
                bad.append(f"prompt {i}: {len(g.output_ids)} tokens, the reference {len(r.output_ids)}")
            continue
        top = r.top_logprobs[j] if j < len(r.top_logprobs) else ()
        gap = top[0][0] - top[1][0] if len(top) >= 2 else float("inf")
        if len(top) < 2 or top[1][1] != g.output_ids[j] or gap > tie_nats:
            bad.append(f"prompt {i}: token {j} is {g.output_ids[j]}, the reference's top two {top} (gap {gap:.3f})")
    return bad


@dataclass(frozen=True)
class Rate:
    """P(the first verify accepts >= 1 draft) over ``n`` requests, with its standard error."""

    hits: int
    n: int

    @property
    def p(self) -> float:
        return self.hits / self.n

    @property
    def se(self) -> float:
        return math.sqrt(max(self.p * (1 - self.p), 1e-12) / self.n)

    def __str__(self) -> str:
        return f"{self.p:.3f} ± {self.se:.3f} ({self.hits}/{self.n})"


def first_verify_rate(results: Sequence[Result]) -> Rate:
    """From max_new_tokens = 2 results: every request must have run exactly one verify."""
    bad = [r for r in results if r.status != 200 or r.verify_ct != 1 or r.correct_drafts is None]
    if bad:
        raise AssertionError(f"{len(bad)} of {len(results)} requests did not run exactly one verify: {bad[:3]}")
    return Rate(sum(1 for r in results if (r.correct_drafts or 0) >= 1), len(results))


def z_diff(a: Rate, b: Rate) -> float:
    """(a - b) / SE of the difference of two independent proportions (pooled SE)."""
    pooled = (a.hits + b.hits) / (a.n + b.n)
    se = math.sqrt(max(pooled * (1 - pooled), 1e-12) * (1 / a.n + 1 / b.n))
    return (a.p - b.p) / se


def token_counts(results: Sequence[Result], position: int) -> Counter[int]:
    return Counter(r.output_ids[position] for r in results if len(r.output_ids) > position)


#: The law checks' false-positive bound (the permutation p-value's resolution is 1/2000).
LAW_ALPHA = 1e-3


def same_law(a: Sequence[Result], b: Sequence[Result], position: int) -> tuple[float, float, int]:
    """(TV, permutation p-value, categories seen) of the tokens at ``position`` of two runs'
    results: whether they come from one law (:func:`two_sample_tv_test`; P(p <= alpha) <=
    alpha under the null, at any number of categories). Every result must have the token."""
    xa = [r.output_ids[position] for r in a if len(r.output_ids) > position]
    xb = [r.output_ids[position] for r in b if len(r.output_ids) > position]
    if len(xa) != len(a) or len(xb) != len(b):
        raise AssertionError(f"results without a token at {position}: {len(a) - len(xa)} and {len(b) - len(xb)}")
    tv, p = two_sample_tv_test(xa, xb, rounds=1999, seed=position)
    return tv, p, len(set(xa) | set(xb))


def arm_counts(url: str) -> dict[str, tuple[int, ...]]:
    """Per arm, the decode's first verifies by accepted length, scraped from ``url``."""
    try:
        arms = parse_prometheus(get_text(url))
    except Exception:  # no first verify recorded yet: the family is absent
        return {}
    return {a: tuple(v.counts) for a, v in arms.items()}


def arm_rates_since(
    url: str, before: dict[str, tuple[int, ...]], expected: int, *, deadline_s: float = 30.0
) -> dict[str, Rate]:
    """Per arm, P(first verify accepts >= 1) over the first verifies recorded since ``before``.

    Waits until ``expected`` new first verifies are in, or ``deadline_s`` has passed.
    """
    deadline, rates = time.monotonic() + deadline_s, {}
    while True:
        now = arm_counts(url)
        rates = {}
        for arm, counts in now.items():
            old = before.get(arm, ())
            delta = [c - (old[k] if k < len(old) else 0) for k, c in enumerate(counts)]
            n = sum(delta)
            rates[arm] = Rate(n - delta[0], n) if n else Rate(0, 0)
        total = sum(r.n for r in rates.values())
        if total >= expected or time.monotonic() > deadline:
            return rates
        time.sleep(1.0)


#: The drop-in's own event counters in SGLang's /metrics (part, event labels).
EVENTS = "pd_middleware_integration_events_total"


def settled_events(url: str, *, deadline_s: float = 30.0) -> dict[str, float]:
    """A node's event samples (``url`` its base URL) once two scrapes 2 s apart agree: the
    copy into SGLang's /metrics runs every second, and a count still on its way would land
    in the next test's delta."""
    deadline = time.monotonic() + deadline_s
    last = None
    while True:
        now = metric_values(get_text(url + "/metrics"), EVENTS)
        if now == last or time.monotonic() > deadline:
            return now
        last = now
        time.sleep(2.0)


def event(values: dict[str, float], part: str, name: str) -> float:
    """The sum of ``values``' samples with labels ``part`` and ``event`` (an exact name)."""
    return sum(v for k, v in values.items() if f'part="{part}"' in k and f'event="{name}"' in k)
