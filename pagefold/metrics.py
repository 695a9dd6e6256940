"""Prometheus metrics of the API server (``GET /metrics``), named as vLLM names them.

Two sources feed them:

* the EngineCore process sends :class:`~pagefold.engine.core_proc.CoreStats` with its outputs
  (queue lengths, pool usage overall and by cache group; cumulative preemptions and
  prefix-cache queries/hits, turned into counter increments here);
* the API process times each request itself: arrival (when the server accepted it) to first
  token (TTFT), between token batches (inter-token latency), arrival to finish (e2e).

Every metric has a private registry per :class:`ServerMetrics`, so several servers (or tests)
in one process never collide. Prefix-cache counters count prompt tokens looked up at each
admission (queries; a preempted request is looked up again) and tokens found cached (hits),
and admissions looked up / admissions with a hit.

Engine counters from the core (cumulative there, turned into counter increments here):
preemptions by kind (swap / recompute), swap-outs and swap-ins with their bytes, tokens a
recompute preemption dropped and of those the tokens credited back by the prefix cache and
state checkpoints, forked requests (parallel-sampling children). Gauges: state checkpoints
cached now and their bytes, the cumulative prefix-cache token hit rate.

A parallel-sampling request (``n`` / ``best_of`` > 1) is one request here: its TTFT is the
first token of any child, its generated tokens those of every child.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0)

_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
_STEP_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """All server metrics, labelled with ``model_name``."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        disable_created_metrics()  # no *_created series: they only confuse dashboards
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        r, m = self.registry, ["model_name"]
        self.running = Gauge("pagefold:num_requests_running",
                             "Requests in the running batch.", m, registry=r)
        self.waiting = Gauge("pagefold:num_requests_waiting",
                             "Requests waiting to be scheduled.", m, registry=r)
        self.kv_usage = Gauge("pagefold:kv_cache_usage_perc",
                              "Fraction of usable pool blocks in use (1 = full).", m, registry=r)
        self.kv_group_usage = Gauge(
            "pagefold:kv_cache_group_usage_perc",
            "Fraction of usable pool blocks held by one cache group.",
            m + ["group", "kind"], registry=r)
        self.free_blocks = Gauge("pagefold:kv_cache_free_blocks",
                                 "Pool blocks free now (cached-but-free included).", m, registry=r)
        self.usable_blocks = Gauge("pagefold:kv_cache_usable_blocks",
                                   "Pool blocks that can ever be handed out.", m, registry=r)
        self.preemptions = Counter("pagefold:num_preemptions",
                                   "Requests preempted (swap or recompute) since start.", m,
                                   registry=r)
        self.preemptions_by_kind = Counter(
            "pagefold:num_preemptions_by_kind", "Requests preempted, by kind.",
            m + ["kind"], registry=r)
        self.swap_outs = Counter("pagefold:num_swap_outs",
                                 "Requests swapped out to the host pool.", m, registry=r)
        self.swap_ins = Counter("pagefold:num_swap_ins",
                                "Requests swapped back in from the host pool.", m, registry=r)
        self.swap_out_bytes = Counter("pagefold:swap_out_bytes",
                                      "Bytes copied from the device pool to the host pool.", m,
                                      registry=r)
        self.swap_in_bytes = Counter("pagefold:swap_in_bytes",
                                     "Bytes copied from the host pool back to the device pool.",
                                     m, registry=r)
        self.recomputed_tokens = Counter(
            "pagefold:recomputed_tokens",
            "Computed tokens dropped by recompute preemptions (to be computed again).", m,
            registry=r)
        self.credited_tokens = Counter(
            "pagefold:recompute_credited_tokens",
            "Of the recomputed tokens, those the prefix cache and state checkpoints give back.",
            m, registry=r)
        self.forks = Counter("pagefold:num_forks",
                             "Requests forked from another (parallel-sampling children).", m,
                             registry=r)
        self.checkpoints = Gauge("pagefold:state_checkpoints",
                                 "State checkpoints cached in the pool now.", m, registry=r)
        self.checkpoint_bytes = Gauge("pagefold:state_checkpoint_bytes",
                                      "Pool bytes held by cached state checkpoints now.", m,
                                      registry=r)
        self.prefix_requests = Counter("pagefold:prefix_cache_requests",
                                       "Admissions looked up in the prefix cache.", m,
                                       registry=r)
        self.prefix_requests_hit = Counter(
            "pagefold:prefix_cache_requests_hit",
            "Admissions that found at least one cached block.", m, registry=r)
        self.prefix_hit_rate = Gauge(
            "pagefold:prefix_cache_hit_rate",
            "Prompt tokens found cached / prompt tokens looked up, since start.", m,
            registry=r)
        self.prefix_queries = Counter("pagefold:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.", m,
                                      registry=r)
        self.prefix_hits = Counter("pagefold:prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache.", m, registry=r)
        self.offload_saves = Counter("pagefold:kv_offload_saves",
                                     "Pages (blocks, state checkpoints) saved to an offload tier.",
                                     m + ["tier"], registry=r)
        self.offload_loads = Counter("pagefold:kv_offload_loads",
                                     "Pages loaded back into the pool from an offload tier.",
                                     m + ["tier"], registry=r)
        self.offload_tokens = Counter(
            "pagefold:kv_offload_tokens_loaded",
            "Prompt tokens served from the offload tiers instead of recomputed.", m, registry=r)
        self.offload_load_failures = Counter(
            "pagefold:kv_offload_load_failures",
            "Offloaded pages found missing, truncated or corrupt (recomputed instead).", m,
            registry=r)
        self.offload_store_failures = Counter(
            "pagefold:kv_offload_store_failures",
            "Pages the disk tier could not write (offload of them skipped).", m, registry=r)
        self.transfer_tokens = Counter(
            "pagefold:kv_transfer_tokens_loaded",
            "Prompt tokens pulled from a prefill instance instead of computed.", m, registry=r)
        self.transfer_bytes = Counter("pagefold:kv_transfer_bytes_loaded",
                                      "Page bytes pulled from prefill instances.", m, registry=r)
        self.transfer_failures = Counter(
            "pagefold:kv_transfer_load_failures",
            "Pages that did not arrive, timed out or failed a checksum (recomputed).", m,
            registry=r)
        self.transfer_pulls = Counter(
            "pagefold:kv_transfer_pulls", "Pulls from prefill instances that landed.", m,
            registry=r)
        self.transfer_pull_seconds = Counter(
            "pagefold:kv_transfer_pull_seconds",
            "Wall time of those pulls, request to answer (divide by kv_transfer_pulls for the "
            "mean transfer latency).", m, registry=r)
        self.transfer_exports = Counter(
            "pagefold:kv_transfer_exports",
            "Prefills whose pages were exported for a decode instance to pull.", m, registry=r)
        self.offload_staged = Counter(
            "pagefold:kv_offload_checkpoints_staged",
            "State checkpoints saved to the tiers through staging pages (the pool was full).",
            m, registry=r)
        self.external_queries = Counter(
            "pagefold:external_prefix_cache_queries",
            "Prompt tokens looked up while a KV connector (offload tiers, transfer) is on.", m,
            registry=r)
        self.external_hits = Counter(
            "pagefold:external_prefix_cache_hits",
            "Prompt tokens loaded through a KV connector (offload tiers, transfer).", m,
            registry=r)
        self.tokens_by_source = Counter(
            "pagefold:prompt_tokens_by_source",
            "Prompt tokens by where their KV came from: computed here, this pool's prefix "
            "cache, a KV connector.", m + ["source"], registry=r)
        self.prompt_tokens_cached = Counter(
            "pagefold:prompt_tokens_cached",
            "Prompt tokens not computed: from the prefix cache or a KV connector.", m,
            registry=r)
        self.prompt_tokens = Counter("pagefold:prompt_tokens", "Prompt tokens processed.", m,
                                     registry=r)
        self.generation_tokens = Counter("pagefold:generation_tokens", "Tokens generated.", m,
                                         registry=r)
        self.request_success = Counter("pagefold:request_success", "Requests finished.",
                                       m + ["finished_reason"], registry=r)
        self.ttft = Histogram("pagefold:time_to_first_token_seconds",
                              "Arrival to first output token.", m, buckets=_TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("pagefold:inter_token_latency_seconds",
                             "Time between output token batches of one request.", m,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("pagefold:e2e_request_latency_seconds",
                             "Arrival to the last output token.", m, buckets=_E2E_BUCKETS,
                             registry=r)
        self.request_prompt_tokens = Histogram(
            "pagefold:request_prompt_tokens", "Prompt tokens per finished request.", m,
            buckets=_TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(
            "pagefold:request_generation_tokens",
            "Generated tokens per finished request (all its samples).", m,
            buckets=_TOKEN_BUCKETS, registry=r)
        self.iteration_tokens = Histogram(
            "pagefold:iteration_tokens_total",
            "Tokens per engine step with outputs: generated tokens plus the prompts whose "
            "prefill completed in it.", m, buckets=_STEP_BUCKETS, registry=r)
        self.request_params_n = Histogram("pagefold:request_params_n",
                                          "The n sampling parameter per finished request.", m,
                                          buckets=_N_BUCKETS, registry=r)
        self.request_params_max_tokens = Histogram(
            "pagefold:request_params_max_tokens", "max_tokens per finished request.", m,
            buckets=_TOKEN_BUCKETS, registry=r)
        # Request phases: arrival -> first scheduled (queue) -> first token (prefill) -> last
        # token (decode); inference = prefill + decode.
        self.queue_time = Histogram("pagefold:request_queue_time_seconds",
                                    "Arrival to first scheduling.", m, buckets=_E2E_BUCKETS,
                                    registry=r)
        self.prefill_time = Histogram("pagefold:request_prefill_time_seconds",
                                      "First scheduling to first token.", m,
                                      buckets=_E2E_BUCKETS, registry=r)
        self.decode_time = Histogram("pagefold:request_decode_time_seconds",
                                     "First token to last token.", m, buckets=_E2E_BUCKETS,
                                     registry=r)
        self.inference_time = Histogram("pagefold:request_inference_time_seconds",
                                        "First scheduling to last token.", m,
                                        buckets=_E2E_BUCKETS, registry=r)
        self.cache_config: Gauge | None = None  # set_cache_config (labels known at start)
        self.spec_drafts = Counter("pagefold:spec_decode_num_drafts",
                                   "Speculative verify rounds with drafts.", m, registry=r)
        self.spec_draft_tokens = Counter("pagefold:spec_decode_num_draft_tokens",
                                         "Drafted tokens.", m, registry=r)
        self.spec_accepted_tokens = Counter("pagefold:spec_decode_num_accepted_tokens",
                                            "Drafted tokens accepted.", m, registry=r)
        self.spec_acceptance_rate = Gauge(
            "pagefold:spec_decode_acceptance_rate",
            "Accepted / drafted tokens since start.", m, registry=r)
        self.spec_mean_accepted_length = Gauge(
            "pagefold:spec_decode_mean_accepted_length",
            "Tokens emitted per verify round (accepted drafts + 1) since start.", m,
            registry=r)
        self._last: dict[str, int] = {}  # last cumulative values seen from the core
        # Counters fed from the core's cumulative values: (counter, CoreStats field).
        self._core_counters = (
            (self.preemptions, "num_preemptions"), (self.prefix_queries, "prefix_queries"),
            (self.prefix_hits, "prefix_hits"), (self.prefix_requests, "prefix_requests"),
            (self.prefix_requests_hit, "prefix_requests_hit"), (self.swap_outs, "swaps_out"),
            (self.swap_ins, "swaps_in"), (self.swap_out_bytes, "swap_bytes_out"),
            (self.swap_in_bytes, "swap_bytes_in"),
            (self.recomputed_tokens, "recomputed_tokens"),
            (self.credited_tokens, "credited_tokens"), (self.forks, "num_forks"),
            (self.spec_drafts, "spec_num_drafts"),
            (self.spec_draft_tokens, "spec_num_draft_tokens"),
            (self.spec_accepted_tokens, "spec_num_accepted_tokens"),
            (self.offload_tokens, "offload_tokens_loaded"),
            (self.offload_load_failures, "offload_load_failures"),
            (self.offload_store_failures, "offload_store_failures"),
            (self.transfer_tokens, "transfer_tokens_loaded"),
            (self.transfer_bytes, "transfer_bytes_loaded"),
            (self.transfer_failures, "transfer_load_failures"),
            (self.transfer_exports, "transfer_exports"),
            (self.offload_staged, "offload_checkpoints_staged"),
            (self.transfer_pulls, "transfer_pulls"),
            (self.transfer_pull_seconds, "transfer_pull_seconds"),
            (self.external_queries, "external_prefix_queries"))
        for metric, _ in self._core_counters:
            metric.labels(model_name)  # exported as 0 before the first event
        for metric in (self.prompt_tokens, self.generation_tokens, self.checkpoints,
                       self.checkpoint_bytes, self.prefix_hit_rate):
            metric.labels(model_name)
        for kind in ("swap", "recompute"):
            self.preemptions_by_kind.labels(model_name, kind)
        for tier in ("host", "disk"):
            self.offload_saves.labels(model_name, tier)
            self.offload_loads.labels(model_name, tier)
        for source in SOURCES:
            self.tokens_by_source.labels(model_name, source)
        self.external_hits.labels(model_name)
        self.prompt_tokens_cached.labels(model_name)

    # ------------------------------------------------------------------ engine-core side
    def record_core_stats(self, stats) -> None:
        """``stats``: a ``CoreStats`` (queue lengths, pool, groups, cumulative counters).

        Invariant: each counter equals the largest cumulative value the core reported (a
        stale or repeated report adds nothing)."""
        name = self.model_name
        self.running.labels(name).set(stats.num_running)
        self.waiting.labels(name).set(stats.num_waiting)
        self.kv_usage.labels(name).set(stats.kv_usage)
        self.free_blocks.labels(name).set(stats.num_free_blocks)
        self.usable_blocks.labels(name).set(stats.num_usable_blocks)
        usable = max(stats.num_usable_blocks, 1)
        for i, g in enumerate(stats.groups):
            self.kv_group_usage.labels(name, str(i), g.kind).set(g.num_blocks / usable)
        for counter, key in self._core_counters:
            self._advance(key, getattr(stats, key), counter.labels(name))
        for kind, value in stats.preemptions_by_kind.items():
            self._advance(f"preempt:{kind}", value,
                          self.preemptions_by_kind.labels(name, kind))
        for tier in ("host", "disk"):
            self._advance(f"offload_save:{tier}", getattr(stats, f"offload_saves_{tier}", 0),
                          self.offload_saves.labels(name, tier))
            self._advance(f"offload_load:{tier}", getattr(stats, f"offload_loads_{tier}", 0),
                          self.offload_loads.labels(name, tier))
        self._record_sources(stats)
        self.checkpoints.labels(name).set(stats.num_checkpoints)
        self.checkpoint_bytes.labels(name).set(stats.checkpoint_bytes)
        if stats.prefix_queries:
            self.prefix_hit_rate.labels(name).set(stats.prefix_hits / stats.prefix_queries)
        drafts = getattr(stats, "spec_num_drafts", 0)
        if drafts:
            acc = stats.spec_num_accepted_tokens
            self.spec_acceptance_rate.labels(name).set(acc / stats.spec_num_draft_tokens)
            self.spec_mean_accepted_length.labels(name).set(1 + acc / drafts)

    def _record_sources(self, stats) -> None:
        """Prompt tokens by source (vLLM's ``prompt_tokens_by_source``): computed by the
        forwards, hit in this pool, loaded through a KV connector (offload, transfer)."""
        name = self.model_name
        external = stats.offload_tokens_loaded + stats.transfer_tokens_loaded
        values = (stats.prompt_tokens_computed, stats.prefix_local_hits, external)
        for source, value in zip(SOURCES, values):
            self._advance(f"source:{source}", value, self.tokens_by_source.labels(name, source))
        self._advance("external_hits", external, self.external_hits.labels(name))
        self._advance("cached", stats.prefix_local_hits + external,
                      self.prompt_tokens_cached.labels(name))

    def _advance(self, key: str, value: float, counter) -> None:
        """Increment ``counter`` by how far the cumulative ``value`` passed the last one."""
        last = self._last.get(key, 0)
        if value > last:
            counter.inc(value - last)
            self._last[key] = value

    # ------------------------------------------------------------------ per request
    def record_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        name = self.model_name
        self.ttft.labels(name).observe(ttft_s)
        self.prompt_tokens.labels(name).inc(num_prompt_tokens)

    def record_tokens(self, num_new_tokens: int, itl_s: float | None) -> None:
        """``itl_s`` is None for the first batch of a request (that one is TTFT)."""
        if num_new_tokens > 0:
            self.generation_tokens.labels(self.model_name).inc(num_new_tokens)
        if itl_s is not None:
            self.itl.labels(self.model_name).observe(itl_s)

    def record_aborted(self, e2e_s: float, num_prompt_tokens: int) -> None:
        """A request that ended without finishing (client gone, shutdown, dead core):
        ``request_success{finished_reason="abort"}``, and its prompt tokens when no token
        had counted them yet (``num_prompt_tokens`` is 0 otherwise)."""
        if num_prompt_tokens:
            self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)
        self.record_finished(e2e_s, "abort")

    def record_finished(self, e2e_s: float, finish_reason: str | None) -> None:
        self.e2e.labels(self.model_name).observe(e2e_s)
        self.request_success.labels(self.model_name, finish_reason or "unknown").inc()

    def record_request_tokens(self, num_prompt_tokens: int, num_generated: int) -> None:
        """Per finished request: its prompt and generated token counts."""
        self.request_prompt_tokens.labels(self.model_name).observe(num_prompt_tokens)
        self.request_generation_tokens.labels(self.model_name).observe(num_generated)

    def record_iteration(self, num_tokens: int) -> None:
        self.iteration_tokens.labels(self.model_name).observe(num_tokens)

    def record_request_params(self, n: int, max_tokens: int | None) -> None:
        self.request_params_n.labels(self.model_name).observe(n)
        if max_tokens is not None:
            self.request_params_max_tokens.labels(self.model_name).observe(max_tokens)

    def record_phases(self, *, queue_s: float, prefill_s: float, decode_s: float,
                      inference_s: float) -> None:
        name = self.model_name
        self.queue_time.labels(name).observe(queue_s)
        self.prefill_time.labels(name).observe(prefill_s)
        self.decode_time.labels(name).observe(decode_s)
        self.inference_time.labels(name).observe(inference_s)

    def set_cache_config(self, info: dict[str, str]) -> None:
        """vLLM's ``cache_config_info``: value 1, the cache configuration in its labels."""
        if self.cache_config is None:
            self.cache_config = Gauge("pagefold:cache_config_info",
                                      "Information of the KV cache configuration.",
                                      sorted(info), registry=self.registry)
        self.cache_config.labels(**info).set(1)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric, each vLLM knows also under its
        ``vllm:`` name (same labels, same values; see :data:`VLLM_NAMES`)."""
        return with_vllm_names(generate_latest(self.registry))

    # ------------------------------------------------------------------ stats line
    def snapshot(self) -> dict[str, float]:
        """Cumulative totals and current gauges for the periodic stats line."""
        name = self.model_name

        def value(metric) -> float:
            return float(metric.labels(name)._value.get())

        return {"prompt_tokens": value(self.prompt_tokens),
                "generation_tokens": value(self.generation_tokens),
                "running": value(self.running), "waiting": value(self.waiting),
                "kv_usage": value(self.kv_usage), "prefix_queries": value(self.prefix_queries),
                "prefix_hits": value(self.prefix_hits),
                "preemptions": value(self.preemptions)}


# ``pagefold:prompt_tokens_by_source``'s sources, vLLM's label values.
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")

# pagefold name -> vLLM's name of the same series (vLLM dashboards read these). Counters carry
# the ``_total`` suffix in the exposition; histograms their ``_bucket``/``_sum``/``_count``.
VLLM_NAMES = {
    "pagefold:num_requests_running": "vllm:num_requests_running",
    "pagefold:num_requests_waiting": "vllm:num_requests_waiting",
    "pagefold:kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "pagefold:num_preemptions": "vllm:num_preemptions",
    "pagefold:prefix_cache_queries": "vllm:prefix_cache_queries",
    "pagefold:prefix_cache_hits": "vllm:prefix_cache_hits",
    "pagefold:prompt_tokens": "vllm:prompt_tokens",
    "pagefold:generation_tokens": "vllm:generation_tokens",
    "pagefold:request_success": "vllm:request_success",
    "pagefold:time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "pagefold:inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "pagefold:e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "pagefold:request_prompt_tokens": "vllm:request_prompt_tokens",
    "pagefold:request_generation_tokens": "vllm:request_generation_tokens",
    "pagefold:iteration_tokens_total": "vllm:iteration_tokens_total",
    "pagefold:request_params_n": "vllm:request_params_n",
    "pagefold:request_params_max_tokens": "vllm:request_params_max_tokens",
    "pagefold:request_queue_time_seconds": "vllm:request_queue_time_seconds",
    "pagefold:request_prefill_time_seconds": "vllm:request_prefill_time_seconds",
    "pagefold:request_decode_time_seconds": "vllm:request_decode_time_seconds",
    "pagefold:request_inference_time_seconds": "vllm:request_inference_time_seconds",
    "pagefold:cache_config_info": "vllm:cache_config_info",
    "pagefold:external_prefix_cache_queries": "vllm:external_prefix_cache_queries",
    "pagefold:external_prefix_cache_hits": "vllm:external_prefix_cache_hits",
    "pagefold:prompt_tokens_by_source": "vllm:prompt_tokens_by_source",
    "pagefold:prompt_tokens_cached": "vllm:prompt_tokens_cached",
}
# Older vLLM names some dashboards still use (same series again).
VLLM_LEGACY_NAMES = {
    "pagefold:kv_cache_usage_perc": "vllm:gpu_cache_usage_perc",
    "pagefold:prefix_cache_hit_rate": "vllm:gpu_prefix_cache_hit_rate",
    "pagefold:inter_token_latency_seconds": "vllm:time_per_output_token_seconds",
    "pagefold:prefix_cache_queries": "vllm:gpu_prefix_cache_queries",
    "pagefold:prefix_cache_hits": "vllm:gpu_prefix_cache_hits",
}


def with_vllm_names(text: bytes) -> bytes:
    """``text`` plus a copy of every series named in :data:`VLLM_NAMES` /
    :data:`VLLM_LEGACY_NAMES` under the vLLM name (HELP/TYPE lines included)."""
    lines = text.decode().splitlines()
    extra: list[str] = []
    for mapping in (VLLM_NAMES, VLLM_LEGACY_NAMES):
        for line in lines:
            body = line[7:] if line.startswith(("# HELP ", "# TYPE ")) else line
            for ours, theirs in mapping.items():
                if body.startswith(ours) and body[len(ours):len(ours) + 1] in ("_", "{", " "):
                    rest = body[len(ours):]
                    # "_total", "_bucket"... are suffixes; other "_x" is a longer name.
                    if rest.startswith("_") and rest.split("{")[0].split(" ")[0] not in (
                            "_total", "_bucket", "_sum", "_count"):
                        continue
                    extra.append(line[:7] + theirs + rest if body is not line
                                 else theirs + rest)
                    break
    return (text.decode() + "\n".join(extra) + ("\n" if extra else "")).encode()


def stats_line(prev: dict[str, float], cur: dict[str, float], seconds: float) -> str:
    """vLLM's periodic engine line from two :meth:`ServerMetrics.snapshot`\\ s."""
    dt = max(seconds, 1e-9)
    queries = cur["prefix_queries"] - prev["prefix_queries"]
    hits = cur["prefix_hits"] - prev["prefix_hits"]
    return (f"Avg prompt throughput: {(cur['prompt_tokens'] - prev['prompt_tokens']) / dt:.1f} "
            f"tokens/s, Avg generation throughput: "
            f"{(cur['generation_tokens'] - prev['generation_tokens']) / dt:.1f} tokens/s, "
            f"Running: {int(cur['running'])} reqs, Waiting: {int(cur['waiting'])} reqs, "
            f"KV cache usage: {100 * cur['kv_usage']:.1f}%, "
            f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%")
