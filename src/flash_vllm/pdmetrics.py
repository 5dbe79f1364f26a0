"""The pd router's Prometheus families (a private registry) and the one /metrics text that also
carries both servers' own families with a `stage` label, so dashboards and `flash test` read one
endpoint. prometheus_client is a vLLM dependency (every vLLM image has it), imported lazily."""

from __future__ import annotations


class Metrics:
    def __init__(self, stages=("prefill", "decode")):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("flash_router_requests", "Client requests by endpoint and outcome (ok, client_error, "
                                "prefill_error, decode_error, decode_down, unauthorized, too_large, length_required, "
                                "body_timeout, disconnected)", ["endpoint", "outcome"], registry=self.registry)
        self.stage_requests = Counter("flash_router_stage_requests", "Requests sent to each stage's server by "
                                      "HTTP status (unreachable: no answer)", ["stage", "status"], registry=self.registry)
        self.stage_seconds = Histogram("flash_router_stage_seconds", "Seconds per stage: prefill = until the "
                                       "prefill server answered; decode = until the last byte of the decode answer",
                                       ["stage"], registry=self.registry,
                                       buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640, 1280))
        self.request_seconds = Histogram("flash_router_request_seconds", "Seconds per client request, end to end",
                                         ["endpoint"], registry=self.registry,
                                         buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640, 1280))
        self.in_flight = Gauge("flash_router_in_flight", "Client requests being served", registry=self.registry)
        self.kv_missing = Counter("flash_router_kv_params_missing", "Prefill answers without kv_transfer_params "
                                  "(the decode server then computes the prompt itself)", registry=self.registry)
        self.up = Gauge("flash_router_backend_up", "1 when the stage's server answered its last /health or "
                        "/metrics call with 200", ["stage"], registry=self.registry)
        for stage in stages:
            self.up.labels(stage).set(0)

    def exposition(self, answers: dict[str, tuple[int, bytes] | None]) -> bytes:
        """Our families, then each server's (stage -> its /metrics answer, None: unreachable)."""
        from prometheus_client import generate_latest
        from prometheus_client.core import Metric
        from prometheus_client.parser import text_string_to_metric_families

        merged: dict[str, Metric] = {}
        for stage, answer in answers.items():
            if answer is None or answer[0] != 200:
                self.up.labels(stage).set(0)
                continue
            try:
                families = list(text_string_to_metric_families(answer[1].decode("utf-8", "replace")))
            except ValueError:
                self.up.labels(stage).set(0)
                continue
            self.up.labels(stage).set(1)
            for fam in families:
                m = merged.get(fam.name)
                if m is None:
                    m = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                for s in fam.samples:
                    m.add_sample(s.name, {**s.labels, "stage": stage}, s.value, s.timestamp)
        return generate_latest(self.registry) + generate_latest(_Families(merged.values()))


class _Families:
    """A registry-shaped wrapper so generate_latest() writes already-collected families."""

    def __init__(self, families):
        self._families = list(families)

    def collect(self):
        return iter(self._families)
