"""Prometheus metrics of a server: requests by outcome, tokens, latencies, the batch and the memory it holds."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..cache.memory import host_pool

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """One registry per server (tests run several in a process)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, scheduler) -> None:
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)  # process_resident_memory_bytes among others
        self.requests = Counter(
            "tandem_requests", "Requests ended, by outcome (stop, length, cancelled, error, rejected, invalid)",
            ["outcome"], registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("tandem_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            "tandem_time_to_first_token_seconds", "From arrival to the first token", buckets=LATENCY_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.token_gap = Histogram(
            "tandem_inter_token_seconds",
            "Between two tokens of one request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_chunk = Histogram(
            "tandem_prefill_chunk_seconds",
            "One prefill chunk (a new request's first with its cache made and any kept prefix restored): the "
            "longest a running stream waits for another prompt",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.decode_step = Histogram(
            "tandem_decode_step_seconds",
            "One decode step of the whole batch",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # the steps and their time by how they ran (`RowsRunner.last_step`) and by width (the batch's power of two
        # at most), so a replayed step's time can be set against a static batch of that width
        self.steps_by_kind = Counter(
            "tandem_decode_steps", "Decode steps, by how they ran (eager, recorded, rebound, replayed) and by "
            "rows_at_most (the batch rounded up to a power of two)", ["kind", "rows_at_most"], registry=r,
        )  # fmt: skip
        self.step_time_by_kind = Counter(
            "tandem_decode_step_time_seconds", "Time in decode steps, by kind and rows_at_most as tandem_decode_steps",
            ["kind", "rows_at_most"], registry=r,
        )  # fmt: skip
        counts = scheduler.counts
        for name, key, doc in (
            ("tandem_requests_waiting", "waiting", "Requests queued for admission"),
            ("tandem_requests_prefilling", "prefilling", "Admitted requests still prefilling"),
            ("tandem_requests_decoding", "decoding", "Requests in the decode batch"),
            (
                "tandem_reserved_host_bytes",
                "reserved_host_bytes",
                "Host memory reserved by admitted requests",
            ),
            (
                "tandem_reserved_device_bytes",
                "reserved_device_bytes",
                "Device memory reserved by admitted requests",
            ),
            ("tandem_live_caches", "live_caches", "Request caches not yet freed"),
        ):
            Gauge(name, doc, registry=r).set_function(lambda key=key: counts()[key])
        if scheduler.prefix is not None:
            r.register(_StatsCollector(scheduler.prefix.stats, PREFIX_COUNTERS, PREFIX_GAUGES))
        r.register(host_pool_collector())
        lim = scheduler.limits
        budgets = Gauge("tandem_budget_bytes", "Memory budgets for admission", ["memory"], registry=r)
        budgets.labels("host").set(-1 if lim.host_bytes is None else lim.host_bytes)
        budgets.labels("device").set(-1 if lim.device_bytes is None else lim.device_bytes)
        stats = scheduler.stats
        stats.on_prefill_chunk = self.prefill_chunk.observe
        stats.on_decode_step = self._decode_step
        stats.on_first_token = self.ttft.observe
        stats.on_token_gap = self.token_gap.observe
        stats.on_finish = self._finished

    def _decode_step(self, seconds: float, batch: int, kind: str) -> None:
        self.decode_step.observe(seconds)
        labels = (kind, str(rows_at_most(batch)))
        self.steps_by_kind.labels(*labels).inc()
        self.step_time_by_kind.labels(*labels).inc(seconds)

    def _finished(self, request, outcome: str) -> None:
        self.requests.labels(outcome).inc()
        self.generation_tokens.inc(request.generated)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def rows_at_most(batch: int) -> int:
    """The `rows_at_most` label of a decode step of `batch` requests: the batch rounded up to a power of two."""
    return 1 << (batch - 1).bit_length()


class _StatsCollector:
    """Counters and gauges read from a statistics dict when scraped: `stats()` returns it, or None for nothing."""

    def __init__(self, stats, counters, gauges) -> None:
        self.stats, self.counters, self.gauges = stats, counters, gauges

    def collect(self):
        stats = self.stats()
        if stats is None:
            return
        for name, key, doc in self.counters:
            yield CounterMetricFamily(name, doc, value=stats[key])
        for name, key, doc in self.gauges:
            yield GaugeMetricFamily(name, doc, value=stats[key])


# the prefix cache's counters and sizes (`cache.prefix.PrefixCache.stats`)
PREFIX_COUNTERS = (
    ("tandem_prefix_lookups", "lookups", "New requests that looked for a kept prompt prefix"),
    ("tandem_prefix_hits", "hits", "New requests that started from a kept prompt prefix"),
    ("tandem_prefix_hit_tokens", "hit_tokens", "Prompt tokens taken from kept prefixes"),
    ("tandem_prefix_taken_over", "adopted", "Hits that took a kept prefix's host rows over, copying none"),
    ("tandem_prefix_restored_bytes", "bytes_restored", "Bytes of kept prefixes the other hits copied"),
    ("tandem_prefix_inserted", "inserted", "Prompt prefixes kept"),
    ("tandem_prefix_evictions", "evictions", "Kept prefixes dropped for room"),
)
PREFIX_GAUGES = (
    ("tandem_prefix_entries", "entries", "Prompt prefixes kept now"),
    ("tandem_prefix_bytes", "bytes", "Host memory the kept prefixes hold"),
)
# the host pool's (`cache.memory.HostPool.stats`, on for a server on CUDA; nothing where it is off)
HOST_POOL_COUNTERS = (
    ("tandem_host_pool_reused", "reused", "Host-tier stores made from the memory of ended ones"),
    ("tandem_host_pool_made", "made", "Host-tier stores mapped (and page-locked) anew"),
    (
        "tandem_host_pool_ahead",
        "ahead",
        "Host-tier stores made ahead of their request, off the model's thread",
    ),
)
HOST_POOL_GAUGES = (("tandem_host_pool_free_bytes", "free_bytes", "Host memory kept for the next stores"),)


def host_pool_collector() -> _StatsCollector:
    """The host pool's metrics, read from whichever pool is on when scraped."""
    return _StatsCollector(
        lambda: None if (pool := host_pool()) is None else pool.stats(), HOST_POOL_COUNTERS, HOST_POOL_GAUGES
    )
