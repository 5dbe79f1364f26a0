"""The /metrics contract: which families a healthy server exports, parsed with prometheus_client.

prometheus_client's parser names a counter family without `_total` (vllm:prefix_cache_hits) and
its samples with it (vllm:prefix_cache_hits_total); both spellings are accepted here.
"""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's own families that every supported release (v0.29 … v0.33) exports on the V1 engine and
# that the checks, the recording rules and the dashboard read.
CORE_FAMILIES: tuple[str, ...] = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
)

# The PLE mmap patch's counters (docs/OBSERVABILITY.md: what each one measures).
PLE_FAMILIES: tuple[str, ...] = (
    "vllm:ple_mmap_lookup_ops",
    "vllm:ple_mmap_op_seconds",
    "vllm:ple_mmap_gpu_wait_seconds",
    "vllm:ple_mmap_dedup_seconds",
    "vllm:ple_mmap_gather_seconds",
    "vllm:ple_mmap_stage_seconds",
    "vllm:ple_mmap_rows",
    "vllm:ple_mmap_bytes",
)


class MetricsError(ValueError):
    """The text is not Prometheus exposition format."""


@dataclass
class Snapshot:
    """One scrape: family name → list of (sample name, labels, value)."""

    families: dict[str, list[tuple[str, dict, float]]]
    types: dict[str, str]

    def has(self, family: str) -> bool:
        return _bare(family) in self.families

    def total(self, name: str, **match: str) -> float | None:
        """Sum of the family's value samples (labels folded, or only those matching `match`);
        None when the family is absent. Histograms: use name_count / name_sum."""
        fam = _bare(name)
        if name.endswith(("_count", "_sum")) and fam not in self.families:
            fam = name.rsplit("_", 1)[0]
        samples = self.families.get(fam)
        if samples is None:
            return None
        wanted = {name, fam, fam + "_total"} if not name.endswith(("_count", "_sum")) else {name}
        return sum(v for n, labels, v in samples
                   if n in wanted and all(labels.get(k) == val for k, val in match.items()))

    def labels_of(self, family: str) -> list[dict]:
        return [labels for _, labels, _ in self.families.get(_bare(family), [])]


def _bare(name: str) -> str:
    return name[:-6] if name.endswith("_total") else name


def parse(text: str) -> Snapshot:
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, list] = {}
    types: dict[str, str] = {}
    try:
        for fam in text_string_to_metric_families(text):
            families.setdefault(fam.name, []).extend((s.name, dict(s.labels), _num(s.value)) for s in fam.samples)
            types[fam.name] = fam.type
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise MetricsError(f"not Prometheus text format: {exc} ({_where(text)})") from None
    return Snapshot(families, types)


def _num(v) -> float:
    """A sample value as float; prometheus_client hands 400-digit integers back as int, which
    float() refuses: Prometheus itself reads them as ±Inf."""
    try:
        return float(v)
    except OverflowError:
        return float("inf") if v > 0 else float("-inf")


def _where(text: str) -> str:
    """Name the bad input: the first line prometheus_client refuses on its own, else the start."""
    from prometheus_client.parser import text_string_to_metric_families

    for n, line in enumerate(text.split("\n"), 1):
        try:
            for fam in text_string_to_metric_families(line + "\n"):
                for s in fam.samples:
                    _num(s.value)
        except (ValueError, TypeError, KeyError, IndexError):
            return f"line {n}: {line[:120]!r}"
    return f"in {text[:120]!r}"


def family_names(text: str) -> set[str]:
    """The set of families in a scrape (what `docs/OBSERVABILITY.md`'s measured diff compares)."""
    return set(parse(text).families)
