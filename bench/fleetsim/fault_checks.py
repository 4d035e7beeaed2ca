"""What ``bench/faults.py`` checks in the product's database once a fault's uploads have settled: every delta
an agent was told was accepted is in exactly one round, aggregated once, into that round's one version; none
left ``received``; no round stuck.

Read straight from PostgreSQL (the run's own embedded server), one snapshot per check:

- the agents' side is the list of sha256s whose ``accepted`` outcome reached an agent (pushed or asked for);
- a delta is **counted** when its row is ``aggregated`` in a ``completed`` round that has exactly one version,
  and the round's ``stats.deltas`` (what the aggregation summed) equals its aggregated rows;
- **duplicates**: an upload stored twice (two rows for one sha256), one device counter accepted twice, a round
  that summed more deltas than it holds, or a round with more than one version;
- **lost**: told accepted, but no row, or a row that is not aggregated in a completed round after the drain;
- **stuck rounds**: a round still ``aggregating``, or ``collecting`` with its buffer full, after the drain;
- **verification given up**: a delta rejected ``verification_failed`` (every device here is honest); with how
  many deltas needed more than one verification run, and the most runs one took (cumulative over the run).
"""

from __future__ import annotations

ROUNDS_SQL = """
SELECT r.id, r.state, r.buffer_size, r.close_reason, r.stats, r.attempts, r.failure,
       (SELECT count(*) FROM training_adapterversion v WHERE v.round_id = r.id) AS versions,
       (SELECT count(*) FROM training_delta d WHERE d.round_id = r.id AND d.state = 'aggregated') AS aggregated,
       (SELECT count(*) FROM training_delta d WHERE d.round_id = r.id AND d.state = 'accepted') AS accepted
FROM training_round r JOIN training_adapter a ON a.id = r.adapter_id
WHERE a.name = %s
"""

STATES_SQL = "SELECT state, count(*) FROM training_delta WHERE adapter_name = %s GROUP BY state"

# Deltas whose verification was given up (begun DELTA_VERIFY_MAX_ATTEMPTS times without an outcome): every
# device here is honest, so a fault must never make the product give one up, and retries show what it cost.
GIVEN_UP_SQL = """
SELECT count(*) FILTER (WHERE rejection_code = 'verification_failed'),
       count(*) FILTER (WHERE verify_attempts > 1), coalesce(max(verify_attempts), 0)
FROM training_delta WHERE adapter_name = %s
"""

TOLD_SQL = """
SELECT d.sha256, count(*), min(d.state), max(d.state), min(d.round_id), max(d.round_id)
FROM training_delta d WHERE d.sha256 = ANY(%s) GROUP BY d.sha256
"""

COUNTER_DUPLICATES_SQL = """
SELECT count(*) FROM (
    SELECT device_id, counter FROM training_delta
    WHERE adapter_name = %s AND state IN ('accepted', 'aggregated')
    GROUP BY device_id, counter HAVING count(*) > 1
) AS twice
"""

ACCEPTED_SINCE_SQL = """
SELECT sha256 FROM training_delta
WHERE adapter_name = %s AND state IN ('accepted', 'aggregated') AND received_at >= to_timestamp(%s)
  AND received_at < to_timestamp(%s)
"""


def _connect(database_url: str):
    import psycopg

    return psycopg.connect(database_url, connect_timeout=5, autocommit=True)


def snapshot(database_url: str, adapter: str) -> dict:
    """Deltas by state and rounds by state, and the rounds that are stuck or miscounted right now."""
    with _connect(database_url) as conn:
        states = dict(conn.execute(STATES_SQL, (adapter,)).fetchall())
        rounds = conn.execute(ROUNDS_SQL, (adapter,)).fetchall()
    by_state: dict[str, int] = {}
    stuck, miscounted, versions_extra = [], [], []
    for rid, state, buffer_size, _reason, stats, _attempts, _failure, versions, aggregated, accepted in rounds:
        by_state[state] = by_state.get(state, 0) + 1
        if state == "aggregating" or (state == "collecting" and accepted >= buffer_size):
            stuck.append(rid)
        if state == "completed" and (versions != 1 or (stats or {}).get("deltas") != aggregated):
            miscounted.append(rid)
        if versions > 1:
            versions_extra.append(rid)
    return {
        "deltas": states,
        "rounds": by_state,
        "stuck_round_ids": stuck,
        "miscounted_round_ids": miscounted,
        "rounds_with_several_versions": versions_extra,
        "failed_rounds": [(r[0], (r[6] or "")[:200]) for r in rounds if r[1] == "failed"],
        "versions": sum(r[7] for r in rounds),
    }


def settled(snap: dict) -> bool:
    """Nothing in motion: no delta waiting for verification or for a round to aggregate it, no round aggregating."""
    deltas = snap["deltas"]
    return not deltas.get("received") and not deltas.get("accepted") and not snap["rounds"].get("aggregating")


def ledger(database_url: str, adapter: str, told: list[str], window: tuple[float, float]) -> dict:
    """The told-accepted uploads of one fault against the database (see the module docstring)."""
    snap = snapshot(database_url, adapter)
    with _connect(database_url) as conn:
        rows = {r[0]: r[1:] for r in conn.execute(TOLD_SQL, (told,)).fetchall()} if told else {}
        counter_twice = conn.execute(COUNTER_DUPLICATES_SQL, (adapter,)).fetchone()[0]
        given_up, retried, most_tries = conn.execute(GIVEN_UP_SQL, (adapter,)).fetchone()
        server_accepted = {r[0] for r in conn.execute(ACCEPTED_SINCE_SQL, (adapter, *window)).fetchall()}
        rounds = {r[0]: r for r in conn.execute(ROUNDS_SQL, (adapter,)).fetchall()}
    counted, lost, stored_twice = [], [], []
    for sha256 in told:
        row = rows.get(sha256)
        if row is None:
            lost.append((sha256, "no row"))
            continue
        count, state_min, state_max, round_min, round_max = row
        if count > 1:
            stored_twice.append(sha256)
        round_ = rounds.get(round_max)
        if state_min != "aggregated" or state_max != "aggregated" or round_ is None:
            lost.append((sha256, f"{state_max}, round {round_max}"))
        elif round_[1] != "completed" or round_[7] != 1:
            lost.append((sha256, f"round {round_max} is {round_[1]} with {round_[7]} versions"))
        else:
            counted.append(sha256)
    duplicates = (
        len(stored_twice)
        + counter_twice
        + len(snap["miscounted_round_ids"])
        + len(snap["rounds_with_several_versions"])
    )
    return {
        "told_accepted": len(told),
        "counted": len(counted),
        "lost": len(lost),
        "lost_examples": lost[:5],
        "duplicates": duplicates,
        "stored_twice": len(stored_twice),
        "counter_accepted_twice": counter_twice,
        "miscounted_round_ids": snap["miscounted_round_ids"],
        "stuck_round_ids": snap["stuck_round_ids"],
        "left_received": snap["deltas"].get("received", 0),
        "verification_given_up": given_up,
        "verification_retried": retried,
        "verification_most_tries": most_tries,
        "left_accepted_not_aggregated": snap["deltas"].get("accepted", 0),
        "server_accepted_in_window": len(server_accepted),
        "server_accepted_agent_not_told": len(server_accepted - set(told)),
        "snapshot": snap,
    }


def classify(uploads: list[str], told: set[str], database_url: str) -> dict:
    """What became of uploads interrupted by a fault: told accepted and counted once, or otherwise."""
    if not uploads:
        return {"total": 0}
    with _connect(database_url) as conn:
        rows = {r[0]: r[1:] for r in conn.execute(TOLD_SQL, (uploads,)).fetchall()}
    out: dict[str, int] = {"total": len(uploads)}
    for sha256 in uploads:
        row = rows.get(sha256)
        if row is None:
            kind = "not stored (the agent gave it up)"
        elif row[0] > 1:
            kind = "stored twice"
        elif row[2] == "aggregated" and sha256 in told:
            kind = "counted once, agent told"
        elif row[2] == "aggregated":
            kind = "counted once, agent not told"
        else:
            kind = f"{row[2]}"
        out[kind] = out.get(kind, 0) + 1
    return out
