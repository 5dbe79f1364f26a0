"""`flash eval`'s plan and results: lm-evaluation-harness (lm-eval) against the running server.

lm-eval's `local-chat-completions` model sends each task's prompts to the server's
/v1/chat/completions (the chat template the users get; generation tasks only: the chat API has no
prompt logprobs). The API key goes in its `header` argument, never in the environment. The default
task set is small on purpose: about 300 generated answers of at most a few hundred tokens, which at
the Spark's ~35 tok/s per stream and SEQS concurrent streams is minutes, not hours (an estimate;
raise --limit for tighter error bars). Results: one JSON per label, and a side-by-side table of two
labels (e.g. MODE=hybrid vs published, DRAFT_VOCAB=1 vs 0, KV_DTYPE=fp8 vs auto).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

# gsm8k: grade-school arithmetic, exact-match on the final number (reasoning survives quantization?);
# ifeval: instruction following with checkable constraints (format, length, keywords)
DEFAULT_TASKS = ("gsm8k", "ifeval")
DEFAULT_LIMIT = 150


@dataclass
class EvalPlan:
    label: str
    url: str  # the server's base URL (no /v1)
    model: str  # served model name
    tasks: list[str]
    limit: int | None
    concurrency: int
    max_gen_toks: int
    include_path: str | None = None
    headers: dict[str, str] = field(default_factory=dict, repr=False)

    def model_args(self) -> dict:
        args = {"model": self.model, "base_url": f"{self.url}/v1/chat/completions", "num_concurrent": self.concurrency,
                "max_retries": 3, "tokenized_requests": False, "tokenizer_backend": None, "max_gen_toks": self.max_gen_toks,
                "timeout": 600}
        if self.headers:
            args["header"] = dict(self.headers)
        return args

    def describe(self) -> dict:
        return {"label": self.label, "url": self.url, "model": self.model, "tasks": self.tasks, "limit": self.limit,
                "concurrency": self.concurrency, "max_gen_toks": self.max_gen_toks, "include_path": self.include_path,
                "auth": bool(self.headers)}


def run(plan: EvalPlan) -> dict:
    """Run lm-eval (imported here: it is heavy) and reduce its output to our results record."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError as exc:
        from .errors import NotAvailable

        raise NotAvailable(f"flash eval needs lm-evaluation-harness, which is not installed here ({exc})",
                           hint="install the eval extra into flash's venv: .venv/bin/pip install -e '.[cli,eval]'") from None

    tm = TaskManager(include_path=plan.include_path) if plan.include_path else TaskManager()
    started = time.time()
    out = lm_eval.simple_evaluate(model="local-chat-completions", model_args=plan.model_args(), tasks=list(plan.tasks),
                                  limit=plan.limit, apply_chat_template=True, task_manager=tm, log_samples=False)
    return record(plan, out, time.time() - started)


def record(plan: EvalPlan, out: dict, seconds: float) -> dict:
    """lm-eval's results → {label, tasks: {task: {metric,filter: {value, stderr}}}, ...}."""
    from importlib.metadata import version

    tasks: dict[str, dict] = {}
    for task, metrics in (out.get("results") or {}).items():
        row = {}
        for key, value in metrics.items():
            # lm-eval keys its metrics "metric,filter"; the rest (alias, sample_len, …) are bookkeeping
            if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
                continue
            err = metrics.get(key.replace(",", "_stderr,", 1))
            row[key] = {"value": value, "stderr": err if isinstance(err, (int, float)) else None}
        tasks[task] = row
    n = {t: (v.get("effective") if isinstance(v, dict) else v) for t, v in (out.get("n-samples") or {}).items()}
    return {"label": plan.label, "plan": plan.describe(), "tasks": tasks, "samples": n, "seconds": round(seconds, 1),
            "lm_eval": version("lm_eval"), "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def save(rec: dict, directory: Path) -> Path:
    import os

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"eval-{rec['label']}.json"
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(rec, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def _fmt(cell: dict | None) -> str:
    if not cell:
        return "-"
    v, e = cell["value"], cell.get("stderr")
    return f"{v:.4f}" + (f" ± {e:.4f}" if isinstance(e, (int, float)) and not math.isnan(e) else "")


def compare(a: dict, b: dict) -> str:
    """Side-by-side table of two results records: task, metric, A, B, B-A."""
    rows = [("task", "metric", a["label"], b["label"], f"{b['label']} - {a['label']}")]
    for task in sorted(set(a["tasks"]) | set(b["tasks"])):
        ta, tb = a["tasks"].get(task, {}), b["tasks"].get(task, {})
        for metric in sorted(set(ta) | set(tb)):
            ca, cb = ta.get(metric), tb.get(metric)
            delta = f"{cb['value'] - ca['value']:+.4f}" if ca and cb else "-"
            rows.append((task, metric, _fmt(ca), _fmt(cb), delta))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
