"""The fault benchmark's report (``bench/faults.py``): the Markdown table with one row per fault and the details
under it (agents' errors by kind, interrupted uploads, rounds, CPU per process group)."""

from __future__ import annotations

from bench.fleetsim.stats import fmt


def _errors(kinds: dict, limit: int = 4) -> str:
    return ", ".join(f"{kind} x{count}" for kind, count in list(kinds.items())[:limit]) or "none"


def _reconnect(r: dict, agents: int) -> str:
    if r["held_min"] >= agents:
        return "none dropped"
    if r["all_reconnected_after_fault_start_seconds"] is None:
        return f"never ({r['held_min']:,} held)"
    return (
        f"{fmt(r['all_reconnected_after_fault_start_seconds'])} / {fmt(max(0.0, r['all_reconnected_after_seconds']))}"
        f" ({r['held_min']:,} held)"
    )


def render_table(results: list[dict], agents: int) -> str:
    header = (
        "| fault | downtime injected s | agents' errors | first new delta accepted, s after recovery | all agents "
        "connected again, s after the fault began / after recovery (fewest held) | told accepted | counted in rounds "
        "| duplicates | lost | left received | stuck rounds | interrupted uploads counted once | verdict |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in results:
        ledger = r.get("ledger")
        if ledger is None:
            lines.append(
                f"| {r['fault']} | {fmt(r['downtime_seconds'])} | - | - | - | - | - | - | - | - | - | - "
                f"| {r['verdict']} ({r['info'].get('detail', '')}) |"
            )
            continue
        interrupted = r["interrupted"]
        counted_once = interrupted.get("counted once, agent told", 0) + interrupted.get(
            "counted once, agent not told", 0
        )
        downtime = "-" if r["fault"] == "cut" else fmt(r["downtime_seconds"])
        lines.append(
            f"| {r['fault']} | {downtime} | {r['errors']:,} | {fmt(r['first_new_accepted_after_seconds'])} "
            f"| {_reconnect(r, agents)} | {ledger['told_accepted']:,} | {ledger['counted']:,} | {ledger['duplicates']} "
            f"| {ledger['lost']} | {ledger['left_received']} | {len(ledger['stuck_round_ids'])} "
            f"| {counted_once} / {interrupted['total']} | {r['verdict']} |"
        )
    return "\n".join(lines)


def render_details(results: list[dict]) -> str:
    lines = []
    for r in results:
        lines.append(f"- **{r['fault']}**: {r['info'].get('detail', '')}")
        if "ledger" not in r:
            continue
        ledger, usage = r["ledger"], r["resources"]
        failed = ledger["snapshot"]["failed_rounds"]
        lines.append(
            f"  - agents' errors by kind: {_errors(r['errors_by_kind'])}; fewest agents held {r['held_min']}, "
            f"all held again {fmt(r['all_reconnected_after_fault_start_seconds'])}s after the fault began, held "
            f"at the end {r['held_end']}; settled {r['settle_seconds']:.0f}s after the traffic stopped"
        )
        lines.append(
            f"  - interrupted uploads: {_errors({k: v for k, v in r['interrupted'].items() if k != 'total'})}; "
            f"server-accepted deltas the agents were not told of: {ledger['server_accepted_agent_not_told']}; "
            f"rounds now {ledger['snapshot']['rounds']}, versions {ledger['snapshot']['versions']}; "
            f"deltas verified more than once so far {ledger['verification_retried']} (most runs "
            f"{ledger['verification_most_tries']}), given up {ledger['verification_given_up']}"
            + (f"; lost: {ledger['lost_examples']}" if ledger["lost"] else "")
            + (f"; failed rounds: {failed[:2]}" if failed else "")
        )
        cpu = ", ".join(
            f"{name} {entry['cpu_percent_of_core']:.0f}%" for name, entry in usage.items() if isinstance(entry, dict)
        )
        lines.append(
            f"  - CPU (% of one core) during the fault's traffic: {cpu}; everything else on the machine "
            f"{usage['rest_of_machine_cpu_percent_of_core']:.0f}%"
        )
    return "\n".join(lines)
