"""The pd router's Prometheus families (a private registry) and the one /metrics text that also
carries every server's own families with `stage` (prefill | decode) and `server` (prefill, decode,
or decode1..decodeN when there are several) labels, so dashboards and `flash test` read one
endpoint. prometheus_client is a vLLM dependency (every vLLM image has it), imported lazily.

Several router workers (pdrouter --workers N > 1): prometheus_client's multiprocess mode. The
supervisor sets PROMETHEUS_MULTIPROC_DIR (a private directory) before anything imports
prometheus_client; every worker writes its values there and a scrape, whichever worker answers it,
reads all of them: counters and histograms summed, `in_flight` and `decode_outstanding` summed over
the live workers (each worker counts its own requests), `backend_up` the most recent verdict of any
live worker."""

from __future__ import annotations

import os


class Metrics:
    def __init__(self, servers=(("prefill", "prefill"), ("decode", "decode"))):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        from prometheus_client import values

        # the mode prometheus_client chose at its import (the env alone can be set later, by a test)
        self.multiprocess = values.ValueClass is not values.MutexValue and bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = _Labelled(Counter("flash_router_requests", "Client requests by endpoint and outcome (ok, client_error, "
                                "prefill_error, decode_error, decode_down, unauthorized, too_large, length_required, "
                                "body_timeout, disconnected)", ["endpoint", "outcome"], registry=self.registry))
        self.stage_requests = _Labelled(Counter("flash_router_stage_requests", "Requests sent to each stage's server by "
                                      "HTTP status (unreachable: no answer)", ["stage", "status"], registry=self.registry))
        self.stage_seconds = _Labelled(Histogram("flash_router_stage_seconds", "Seconds per stage: prefill = until the "
                                       "prefill server answered; decode = until the last byte of the decode answer",
                                       ["stage"], registry=self.registry,
                                       buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640, 1280)))
        self.request_seconds = _Labelled(Histogram("flash_router_request_seconds", "Seconds per client request, end to end",
                                         ["endpoint"], registry=self.registry,
                                         buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640, 1280)))
        self.in_flight = Gauge("flash_router_in_flight", "Client requests being served", registry=self.registry,
                               multiprocess_mode="livesum")
        self.kv_missing = Counter("flash_router_kv_params_missing", "Prefill answers without kv_transfer_params "
                                  "(the decode server then computes the prompt itself)", registry=self.registry)
        self.up = Gauge("flash_router_backend_up", "1 when the server answered its last /health or "
                        "/metrics call with 200", ["stage", "server"], registry=self.registry,
                        multiprocess_mode="livemostrecent")
        self.outstanding = _Labelled(Gauge("flash_router_decode_outstanding", "Requests assigned to each decode server "
                                 "(from their prefill to their last byte); the router picks the lowest",
                                 ["server"], registry=self.registry, multiprocess_mode="livesum"))
        for stage, server in servers:
            self.up.labels(stage, server).set(0)
            if stage == "decode":
                self.outstanding.labels(server).set(0)

    def exposition(self, answers: dict[tuple[str, str], tuple[int, bytes] | None]) -> bytes:
        """Our families, then each server's ((stage, server) -> its /metrics answer, None: unreachable)."""
        from prometheus_client import generate_latest
        from prometheus_client.core import Metric
        from prometheus_client.parser import text_string_to_metric_families

        merged: dict[str, Metric] = {}
        for (stage, server), answer in answers.items():
            if answer is None or answer[0] != 200:
                self.up.labels(stage, server).set(0)
                continue
            try:
                families = list(text_string_to_metric_families(answer[1].decode("utf-8", "replace")))
            except ValueError:
                self.up.labels(stage, server).set(0)
                continue
            self.up.labels(stage, server).set(1)
            for fam in families:
                m = merged.get(fam.name)
                if m is None:
                    m = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                for s in fam.samples:
                    m.add_sample(s.name, {**s.labels, "stage": stage, "server": server}, s.value, s.timestamp)
        return generate_latest(self.own()) + generate_latest(_Families(merged.values()))

    def own(self):
        """The registry a scrape writes: this process's, or with several workers every worker's files."""
        if not self.multiprocess:
            return self.registry
        from prometheus_client import CollectorRegistry
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return registry


class _Labelled:
    """A labelled family whose children are kept by label values: prometheus_client's labels()
    validates and builds its key on every call (~8 us), and the request path calls it ~8 times
    per request (profile of issue 34's 200 x 5 load)."""

    def __init__(self, family):
        self.family, self._children = family, {}

    def labels(self, *values: str):
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.family.labels(*values)
        return child

    def __getattr__(self, name):
        return getattr(self.family, name)


class _Families:
    """A registry-shaped wrapper so generate_latest() writes already-collected families."""

    def __init__(self, families):
        self._families = list(families)

    def collect(self):
        return iter(self._families)
