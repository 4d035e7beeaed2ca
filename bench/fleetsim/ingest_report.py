"""The fleet simulator's Markdown table (one row per phase, the baseline's rows first) and per-phase details."""

from __future__ import annotations

from bench.fleetsim.stats import fmt


def _cpu(phase: dict, group: str) -> str:
    entry = phase["resources"].get(group)
    return fmt(entry["cpu_percent_of_core"], 0) if entry else "-"


def _rss(phase: dict, group: str) -> str:
    entry = phase["resources"].get(group)
    return fmt(entry["rss_mb_peak"], 0) if entry else "-"


def _baseline_for(phases: list[dict], phase: dict) -> dict | None:
    for other in phases:
        if other["server"] == "no-op" and other["mode"] == phase["mode"] and other is not phase:
            return other
    return None


def render_table(phases: list[dict]) -> str:
    header = (
        "| phase | upload | agents held (min / mean of N) | offered deltas/s | "
        "ingest deltas/s (verified, in a round) | vs no-op | first byte -> verified p50 / p99 ms | "
        "first byte -> stored p50 / p99 ms | rejected | errors | "
        "web CPU % | worker CPU % | postgres CPU % | redis CPU % | simulator CPU % | machine CPU % | "
        "web / worker RSS MB (peak) |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for p in phases:
        base = _baseline_for(phases, p)
        ratio = (
            f"{p['ingest_per_second'] / base['ingest_per_second']:.2f}x"
            if base and base["ingest_per_second"] and p["server"] != "no-op"
            else "-"
        )
        verified, stored = p["first_byte_to_verified_ms"], p["first_byte_to_stored_ms"]
        lines.append(
            f"| {p['server']} | {p['mode']} | {p['held_min']:,} / {fmt(p['held'].get('mean'), 0)} of {p['agents']:,} "
            f"| {fmt(p['offered_per_second'], 0)} | **{fmt(p['ingest_per_second'], 1)}** | {ratio} "
            f"| {fmt(verified.get('p50'), 0)} / {fmt(verified.get('p99'), 0)} "
            f"| {fmt(stored.get('p50'), 0)} / {fmt(stored.get('p99'), 0)} "
            f"| {sum(p['rejected_in_window'].values())} | {sum(p['errors_in_window'].values())} "
            f"| {_cpu(p, 'web')} | {_cpu(p, 'worker')} | {_cpu(p, 'postgres')} | {_cpu(p, 'redis')} "
            f"| {_cpu(p, 'simulator')} | {fmt(p['resources']['machine_cpu_percent_of_all_cores'], 0)} "
            f"| {_rss(p, 'web')} / {_rss(p, 'worker')} |"
        )
    return "\n".join(lines)


def _top(counts: dict, limit: int = 6) -> str:
    ordered = sorted(counts.items(), key=lambda item: -item[1])[:limit]
    return ", ".join(f"{kind} x{count}" for kind, count in ordered) or "none"


def render_details(phases: list[dict]) -> str:
    lines = []
    for p in phases:
        r = p["resources"]
        others = ", ".join(
            f"{name} {entry['cpu_percent_of_core']:.0f}% ({entry['processes']} processes, "
            f"{entry['rss_mb_peak']:.0f} MB)"
            for name, entry in r.items()
            if isinstance(entry, dict)
        )
        lines += [
            f"- **{p['server']}, {p['mode']}** ({p['window_seconds']:.0f} s measured after {p['warmup_seconds']:.0f} s "
            f"of warm-up)",
            f"  - uploads: {p['uploads_started_in_window']:,} started in the window "
            f"({p['uploads_started_in_window'] / p['window_seconds']:.1f}/s), {p['accepted_in_window']:,} accepted; "
            f"{p['ticks_skipped_no_idle_agent']:,} scheduler ticks found no idle agent; outcome learnt: "
            f"{_top(p['outcome_learnt'])}; stored -> verified p50 {fmt(p['stored_to_verified_ms'].get('p50'), 0)} "
            f"ms, p99 {fmt(p['stored_to_verified_ms'].get('p99'), 0)} ms; still in flight after "
            f"{p['drain_seconds']:.0f} s of drain: {p['unfinished_after_drain']}",
            f"  - connections: {p['connected_at_start']:,} of {p['agents']:,} connected after "
            f"{p['connect_seconds']:.0f} s; {p['drops']} sockets cut on purpose in the window, "
            f"{p['handshakes'] - p['connected_at_start']:,} reconnects in the phase; heartbeat round trip p50 "
            f"{fmt(p['heartbeat_rtt_ms'].get('p50'), 1)} ms, p99 {fmt(p['heartbeat_rtt_ms'].get('p99'), 1)} ms "
            f"over {p['heartbeat_rtt_ms']['count']:,} beats",
            f"  - errors in the window: {_top(p['errors_in_window'])}; whole phase: {_top(p['errors_whole_phase'])}; "
            f"rejected: {_top(p['rejected_in_window'])}",
            f"  - CPU (% of one core) and peak RSS: {others}; everything else on the machine (other users) "
            f"{r['rest_of_machine_cpu_percent_of_core']:.0f}%; simulator loop lag p99 "
            f"{fmt(p['simulator_loop_lag_ms'].get('p99'), 0)} ms, longest GC pause "
            f"{fmt(p['simulator_gc_pauses_ms'].get('max'), 0)} ms",
        ]
        totals = p.get("server_totals")
        if totals:
            seconds = [s for s in totals["aggregation_seconds"] if s is not None]
            lines.append(
                f"  - server after the phase: deltas {totals['deltas']}, rounds {totals['rounds']}, "
                f"{totals['deltas_in_rounds']:,} deltas counted in rounds (the agents were told of "
                f"{p['accepted_total']:,} acceptances before their phases ended), {totals['versions_made']} versions "
                f"made, aggregation "
                f"{fmt(sum(seconds) / len(seconds), 2) if seconds else '-'} s per round on average"
                + (f"; round failures: {totals['failures'][:2]}" if totals["failures"] else "")
            )
        if p.get("log_problems"):
            lines.append(f"  - launcher log during the phase: {p['log_problems']['lines']} warning/error lines")
        for group, profile in (p.get("profile") or {}).items():
            inclusive = "; ".join(f"{frame} {share}%" for frame, share in profile["inclusive"][:10])
            own = "; ".join(f"{frame} {share}%" for frame, share in profile["self"][:8])
            lines.append(
                f"  - py-spy, {group} ({profile['busy_samples']:,} busy samples, {profile['idle_samples']:,} idle): "
                f"inclusive: {inclusive}. Self: {own}"
            )
    return "\n".join(lines)
