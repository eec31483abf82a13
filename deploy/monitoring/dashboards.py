#!/usr/bin/env python3
"""The Grafana dashboards, as code: this file is their source; the JSON under
charts/shimmer/dashboards/ is generated from it and never edited by hand.

    deploy/monitoring/dashboards.py            # rewrite the JSON
    deploy/monitoring/dashboards.py --check    # exit 1 when the JSON is not what this file makes

Three dashboards — serving, experts, cluster — each a list of rows of panels, each panel a
title, a unit and its PromQL queries (legend per query). Every query reads `shimmer_*` series
(docs/api.md, docs/cluster.md); the Prometheus data source is a dashboard variable, so the
same JSON works in any Grafana (the chart's ConfigMaps, a compose stack's provisioning).
"""
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "charts/shimmer/dashboards"
RATE = "$__rate_interval"


def q(expr: str, legend: str = "") -> dict:
    return {"expr": expr, "legend": legend}


def quantiles(metric: str, by: str = "") -> list[dict]:
    group = f"le{', ' + by if by else ''}"
    label = f"{{{{{by}}}}} " if by else ""
    return [q(f"histogram_quantile({p}, sum by ({group}) (rate({metric}_bucket[{RATE}])))", f"{label}p{int(p * 100)}") for p in (0.5, 0.95, 0.99)]


DASHBOARDS = {
    "serving": {
        "title": "shimmer / serving",
        "rows": [
            [
                ("Requests per second by outcome", "reqps", [q(f"sum by (outcome) (rate(shimmer_request_total[{RATE}]))", "{{outcome}}")]),
                ("Tokens per second", "short", [
                    q(f"sum(rate(shimmer_generation_tokens_total[{RATE}]))", "generated"),
                    q(f"sum(rate(shimmer_prompt_tokens_total[{RATE}]))", "prompt"),
                ]),
                ("Requests running and waiting", "short", [
                    q("sum(shimmer_num_requests_running)", "running"),
                    q("sum(shimmer_num_requests_waiting)", "waiting"),
                ]),
            ],
            [
                ("Time to first token", "s", quantiles("shimmer_time_to_first_token_seconds")),
                ("Inter-token latency", "s", quantiles("shimmer_inter_token_latency_seconds")),
                ("Queue time", "s", quantiles("shimmer_request_queue_time_seconds")),
            ],
            [
                ("End-to-end latency", "s", quantiles("shimmer_e2e_request_latency_seconds")),
                ("KV cache use", "percentunit", [q("max(shimmer_kv_cache_usage_perc)", "KV held / budget")]),
                ("Prefix cache", "short", [
                    q(f"sum(rate(shimmer_prefix_cache_hits_total[{RATE}])) / clamp_min(sum(rate(shimmer_request_total[{RATE}])), 1e-9)", "hits per request"),
                    q(f"sum(rate(shimmer_prefix_cache_reused_tokens_total[{RATE}]))", "reused tokens / s"),
                ]),
            ],
        ],
    },
    "experts": {
        "title": "shimmer / experts",
        "rows": [
            [
                ("Hit rate per tier", "percentunit", [
                    q(f"sum by (tier) (rate(shimmer_expert_accesses_total[{RATE}])) / ignoring(tier) group_left sum(rate(shimmer_expert_accesses_total[{RATE}]))", "{{tier}}"),
                ]),
                ("Expert bytes read per second", "Bps", [q(f"sum(rate(shimmer_expert_bytes_read_total[{RATE}]))", "read")]),
                ("Prefetch", "short", [
                    q(f"sum(rate(shimmer_expert_prefetch_issued_total[{RATE}]))", "issued / s"),
                    q(f"sum(rate(shimmer_expert_prefetch_useful_total[{RATE}])) / clamp_min(sum(rate(shimmer_expert_prefetch_issued_total[{RATE}])), 1e-9)", "useful fraction"),
                ]),
            ],
            [
                ("Time waiting for expert reads", "percentunit", [q(f"sum(rate(shimmer_expert_io_wait_seconds_total[{RATE}]))", "I/O wait (s per s)")]),
                ("Experts in RAM", "short", [
                    q("sum(shimmer_expert_resident)", "resident"),
                    q("sum(shimmer_expert_pinned)", "pinned"),
                    q("sum(shimmer_expert_cache_capacity)", "capacity"),
                ]),
                ("Read errors and mirror fallbacks", "short", [
                    q(f"sum(increase(shimmer_expert_read_errors_total[{RATE}]))", "read errors"),
                    q(f"sum(increase(shimmer_expert_mirror_fallbacks_total[{RATE}]))", "mirror fallbacks"),
                ]),
            ],
            [
                ("Experts in VRAM", "bytes", [
                    q("sum(shimmer_vram_resident_bytes)", "resident"),
                    q("sum(shimmer_vram_budget_bytes)", "budget"),
                ]),
                ("VRAM uploads per second", "Bps", [q(f"sum(rate(shimmer_vram_upload_bytes_total[{RATE}]))", "uploaded")]),
                ("GPU faults (recomputed on the CPU)", "short", [q(f"sum by (kind) (increase(shimmer_gpu_faults_total[{RATE}]))", "{{kind}}")]),
            ],
        ],
    },
    "cluster": {
        "title": "shimmer / cluster",
        "rows": [
            [
                ("Workers up (as the coordinators see them)", "short", [q("min by (worker) (shimmer_worker_up)", "{{worker}}")]),
                ("Request round trip per worker", "s", quantiles("shimmer_worker_request_rtt_seconds", "worker")),
                ("Expert failovers per second", "short", [q(f"sum(rate(shimmer_expert_failovers_total[{RATE}]))", "failovers")]),
            ],
            [
                ("Network bytes per token", "bytes", [
                    q(f"(sum(rate(shimmer_network_bytes_sent_total[{RATE}])) + sum(rate(shimmer_network_bytes_received_total[{RATE}]))) / clamp_min(sum(rate(shimmer_cluster_tokens_total[{RATE}])), 1e-9)", "bytes / token"),
                ]),
                ("Round trips per token", "short", [
                    q(f"sum(rate(shimmer_network_round_trips_total[{RATE}])) / clamp_min(sum(rate(shimmer_cluster_tokens_total[{RATE}])), 1e-9)", "round trips / token"),
                ]),
                ("Network wait per second", "percentunit", [q(f"sum(rate(shimmer_network_wait_seconds_total[{RATE}]))", "waiting for workers")]),
            ],
            [
                ("Raft term and leaders", "short", [
                    q("max(shimmer_raft_term)", "term"),
                    q("sum(shimmer_raft_is_leader)", "leaders"),
                    q("max(increase(shimmer_raft_leader_changes_total[1h]))", "leader changes (1 h)"),
                ]),
                ("Raft apply lag", "short", [q("max by (instance) (shimmer_raft_apply_lag)", "{{instance}}")]),
                ("Placement epoch", "short", [q("max by (model) (shimmer_cluster_placement_epoch)", "{{model}}")]),
            ],
        ],
    },
}


def dashboard(uid: str, spec: dict) -> dict:
    panels, next_id = [], 1
    for r, row in enumerate(spec["rows"]):
        width = 24 // len(row)
        for c, (title, unit, queries) in enumerate(row):
            panels.append({
                "id": next_id,
                "type": "timeseries",
                "title": title,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": width, "x": c * width, "y": r * 8},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
                "targets": [
                    {"refId": chr(ord("A") + i), "datasource": {"type": "prometheus", "uid": "${datasource}"}, "expr": t["expr"], "legendFormat": t["legend"]}
                    for i, t in enumerate(queries)
                ],
            })
            next_id += 1
    return {
        "uid": f"shimmer-{uid}",
        "title": spec["title"],
        "tags": ["shimmer"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [{"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus"}]},
        "panels": panels,
    }


def rendered() -> dict[str, str]:
    return {f"{uid}.json": json.dumps(dashboard(uid, spec), indent=2, sort_keys=True) + "\n" for uid, spec in DASHBOARDS.items()}


def queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, expression) of every query: what the tests ask Prometheus."""
    return [(uid, title, t["expr"]) for uid, spec in DASHBOARDS.items() for row in spec["rows"] for title, _, qs in row for t in qs]


def main() -> int:
    files = rendered()
    if "--check" in sys.argv[1:]:
        stale = [n for n, text in files.items() if not (OUT / n).exists() or (OUT / n).read_text() != text]
        extra = [p.name for p in OUT.glob("*.json") if p.name not in files]
        if stale or extra:
            print(f"charts/shimmer/dashboards/ is not what deploy/monitoring/dashboards.py makes: {stale + extra}; run it", file=sys.stderr)
            return 1
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (OUT / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
