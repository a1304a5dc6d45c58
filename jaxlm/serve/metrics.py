"""The server's Prometheus metrics: the engine's counters read at each scrape, and latencies
observed as requests finish."""

from __future__ import annotations

import itertools

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Seconds; a step of a small model on a CPU takes milliseconds, a long prompt seconds.
_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)


class _EngineCollector:
    """`LLMEngine.stats()` as gauges and counters, read when Prometheus scrapes."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        gauges = {
            "requests_running": ("Requests running in the batch.", s.running),
            "requests_waiting": ("Requests waiting for a slot or pages.", s.waiting),
            "kv_pages_in_use": ("KV-cache pages referenced by a sequence.", s.pages_in_use),
            "kv_pages_free": ("KV-cache pages free or evictable.", s.pages_free),
            "kv_pages_cached": ("KV-cache pages held by the prefix cache.", s.pages_cached),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"jaxlm_{name}", doc, value=value)
        counters = {
            "prefix_cache_hit_tokens": (
                "Prompt tokens taken from the prefix cache.",
                s.cached_prompt_tokens,
            ),
            "prompt_tokens": ("Prompt tokens computed.", s.prefill_tokens),
            "generation_tokens": ("Tokens generated.", s.generated_tokens),
            "preemptions": ("Sequences preempted for pages.", s.preemptions),
            "engine_steps": ("Steps the engine ran.", s.steps),
            "engine_calls": ("XLA calls that ran the steps.", s.calls),
            "spec_decode_num_draft_tokens": (
                "Tokens drafted (`--speculative` or `--draft-model`).",
                s.drafted_tokens,
            ),
            "spec_decode_num_accepted_tokens": (
                "Drafted tokens the model kept.",
                s.accepted_tokens,
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"jaxlm_{name}", doc, value=value)


class Metrics:
    """The registry of one server (its own, so that several servers can run in one process)."""

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.time_to_first_token = Histogram(
            "jaxlm_time_to_first_token_seconds",
            "From a request's arrival to its first token.",
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "jaxlm_inter_token_latency_seconds",
            "Between consecutive tokens of a request.",
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "jaxlm_requests",
            "Requests answered, by endpoint and outcome.",
            ["endpoint", "outcome"],
            registry=self.registry,
        )

    def observe(self, arrival: float, token_times: list[float]) -> None:
        if token_times:
            self.time_to_first_token.observe(token_times[0] - arrival)
        for before, after in itertools.pairwise(token_times):
            self.inter_token_latency.observe(after - before)
