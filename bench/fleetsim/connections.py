"""The phases of ``agent_connections.py`` (a baseline and the target: ramp, steady window, mass disconnect) and
their report, on top of ``server`` (the product) and ``generator`` (the load-generator processes)."""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

from bench.fleetsim import say
from bench.fleetsim.agent import AGENT_VERSION, HARDWARE
from bench.fleetsim.generator import GeneratorProcess
from bench.fleetsim.resources import cpu_percent, cpu_seconds, established, rss, safe
from bench.fleetsim.resources import machine_cpu as machine_cpu_percent
from bench.fleetsim.server import Server
from bench.fleetsim.stats import fmt, summary

CREATE_DEVICES = r"""
import json, sys, uuid
import django
django.setup()
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from devices.models import Cohort, Device, DeviceStatus
from edge_agent.protocol import b64encode

count, out, cohort_name, agent_version = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
hardware = json.loads(sys.argv[5])
cohort = Cohort.objects.create(name=cohort_name, description="agent_connections benchmark")
rows, keys = [], []
for index in range(count):
    key = Ed25519PrivateKey.generate()
    device_id = uuid.uuid4()
    rows.append(Device(
        id=device_id, name=f"bench-{index:06d}", cohort=cohort, status=DeviceStatus.ACTIVE,
        public_key=b64encode(key.public_key().public_bytes_raw()),
        # what the simulated agents report in their hello, so a hello writes nothing (a reconnecting fleet)
        agent_version=agent_version, hardware=hardware,
    ))
    keys.append({"id": str(device_id), "seed": key.private_bytes_raw().hex()})
Device.objects.bulk_create(rows, batch_size=2000)
with open(out, "w") as f:
    json.dump(keys, f)
print(Device.objects.filter(cohort=cohort, status=DeviceStatus.ACTIVE).count())
"""


def create_devices(server: Server, count: int, keys_file: Path) -> float:
    """One cohort and ``count`` active devices with fresh Ed25519 keys, straight in the database; the keys go
    to ``keys_file`` for the generators. Returns the seconds it took."""
    started = time.monotonic()
    out = server.run_django(
        CREATE_DEVICES,
        str(count),
        str(keys_file),
        f"bench-conn-{server.run_id}",
        AGENT_VERSION,
        json.dumps(HARDWARE),
        what="creating devices",
    )
    created = int(out.strip().splitlines()[-1])
    if created != count:
        raise RuntimeError(f"created {created} devices, expected {count}")
    return time.monotonic() - started


def run_phase(
    *,
    name: str,
    connections: int,
    first_device: int,
    hold: float,
    args: argparse.Namespace,
    server: Server,
    keys_file: Path,
    workdir: Path,
    generator_log,
) -> dict:
    import psutil

    procs = max(1, min(args.generator_procs, connections))
    say(f"phase {name}: {connections} connections from {procs} generator process(es), ramp {args.ramp_rate}/s")
    time.sleep(args.settle)
    web = server.web_processes()
    idle_rss = rss(web)
    idle_presence = server.presence_connections()
    log_offset = server.log_offset()

    generators: list[GeneratorProcess] = []
    share, extra = divmod(connections, procs)
    ramp_cpu_web0, ramp_system0, ramp_started = cpu_seconds(web), psutil.cpu_times(), time.monotonic()
    first = first_device
    try:
        for index in range(procs):
            count = share + (1 if index < extra else 0)
            cfg = {
                "phase": name,
                "url": f"ws://127.0.0.1:{server.port}/ws/agent/",
                "keys_file": str(keys_file),
                "first": first,
                "count": count,
                "rate": args.ramp_rate / procs,
                "interval": args.interval,
                "handshake_timeout": args.handshake_timeout,
                "ack_timeout": args.ack_timeout,
                "close_timeout": 10.0,
                "compression": args.compression,
            }
            first += count
            generators.append(GeneratorProcess(index, cfg, workdir, generator_log))

        ramp_timeout = connections / args.ramp_rate + args.handshake_timeout + 60
        ramped = [g.expect("RAMPED", ramp_timeout) for g in generators]
        ramp_seconds = max(r["ramp_seconds"] for r in ramped)
        connected = sum(r["connected"] for r in ramped)
        ramp_wall = time.monotonic() - ramp_started
        ramp_cpu = {
            "wall_seconds": ramp_wall,
            "server_cpu_percent_of_core": cpu_percent(ramp_cpu_web0, cpu_seconds(server.web_processes()), ramp_wall),
            "generator_cpu_percent_of_core": cpu_percent(
                {}, cpu_seconds([psutil.Process(g.process.pid) for g in generators]), ramp_wall
            ),
            "machine_cpu_percent_of_all_cores": machine_cpu_percent(ramp_system0, psutil.cpu_times()),
        }
        say(
            f"phase {name}: ramp done in {ramp_seconds:.1f}s, {connected} connected, "
            f"{sum(r['handshake_failed'] for r in ramped)} handshakes failed"
        )

        # Steady state: every generator starts recording round trips at (about) the same moment.
        web = server.web_processes()
        celery = server.worker_processes()
        gen_ps = [psutil.Process(g.process.pid) for g in generators]
        for g in generators:
            g.send("STEADY")
        window_start = time.monotonic()
        cpu_web0, cpu_celery0, cpu_gen0 = cpu_seconds(web), cpu_seconds(celery), cpu_seconds(gen_ps)
        system0 = psutil.cpu_times()
        rss_samples = []
        while True:
            remaining = hold - (time.monotonic() - window_start)
            if remaining <= 0:
                break
            time.sleep(min(10.0, remaining))
            if not server.alive():
                raise RuntimeError(f"the launcher exited during phase {name}; see {server.log_path}")
            rss_samples.append(rss(server.web_processes()))
        window = time.monotonic() - window_start
        web = server.web_processes()
        cpu_web = cpu_percent(cpu_web0, cpu_seconds(web), window)
        cpu_celery = cpu_percent(cpu_celery0, cpu_seconds(server.worker_processes()), window)
        cpu_gen = cpu_percent(cpu_gen0, cpu_seconds(gen_ps), window)
        machine_cpu = machine_cpu_percent(system0, psutil.cpu_times())
        steady_rss = rss(web)
        per_worker = [
            {
                "pid": p.pid,
                "rss_mb": safe(lambda p=p: p.memory_info().rss, 0) / 2**20,
                "established": established(p, server.port),
                "cpu_percent": cpu_percent({p.pid: cpu_web0.get(p.pid, 0.0)}, cpu_seconds([p]), window),
            }
            for p in server.web_workers()
        ]
        steady_presence = server.presence_connections()

        for g in generators:
            g.send("STOP")
        results = [g.expect("RESULT", args.ack_timeout + 60) for g in generators]
        closed = [g.expect("CLOSED", 120) for g in generators]
    finally:
        for g in generators:
            g.stop()

    # After the mass disconnect every socket's presence entry should be gone (devices.presence._RELEASE).
    drain_started = time.monotonic()
    leftover = server.presence_connections()
    while leftover > idle_presence and time.monotonic() - drain_started < args.drain_timeout:
        time.sleep(0.5)
        leftover = server.presence_connections()
    drain_seconds = time.monotonic() - drain_started

    rtts = [rtt for r in results for rtt in r["rtt_ms"]]
    held = sum(r["held"] for r in results)
    failure_reasons: Counter[str] = Counter()
    close_codes: Counter[str] = Counter()
    for r in results:
        failure_reasons.update(r["failure_reasons"])
        close_codes.update(r["close_codes"])
    per_connection_kb = (steady_rss - idle_rss) / held / 1024 if held else None
    phase = {
        "phase": name,
        "target": connections,
        "held": held,
        "handshake_failed": sum(r["handshake_failed"] for r in results),
        "dropped": sum(r["dropped"] for r in results),
        "lost_heartbeats": sum(r["lost_heartbeats"] for r in results),
        "unfinished_heartbeats": sum(r["unfinished_heartbeats"] for r in results),
        "heartbeats_in_window": sum(r["sent_in_window"] for r in results),
        "rtt_ms": summary(rtts),
        "window_seconds": window,
        "ramp_seconds": ramp_seconds,
        "ramp_rate_achieved": connections / ramp_seconds if ramp_seconds else None,
        "ramp_cpu": ramp_cpu,
        "server_rss_idle_mb": idle_rss / 2**20,
        "server_rss_steady_mb": steady_rss / 2**20,
        "server_rss_samples_mb": [s / 2**20 for s in rss_samples],
        "kb_per_connection": per_connection_kb,
        "server_cpu_percent_of_core": cpu_web,
        "celery_worker_cpu_percent_of_core": cpu_celery,
        "generator_cpu_percent_of_core": cpu_gen,
        "machine_cpu_percent_of_all_cores": machine_cpu,
        "web_workers": per_worker,
        "generator_processes": len(generators),
        "generators": [
            {
                k: r[k]
                for k in (
                    "devices",
                    "held",
                    "ramp_seconds",
                    "handshake_ms",
                    "upgrade_ms",
                    "hello_ms",
                    "loop_lag_ms",
                    "gc_pauses_ms",
                )
            }
            for r in results
        ],
        "failure_reasons": dict(failure_reasons),
        "close_codes": dict(close_codes),
        "presence_conn_idle": idle_presence,
        "presence_conn_steady": steady_presence,
        "mass_disconnect": {
            "closed": sum(c["closed"] for c in closed),
            "close_errors": sum(c["errors"] for c in closed),
            "client_close_seconds": max(c["seconds"] for c in closed),
            "presence_conn_left": leftover - idle_presence,
            "waited_seconds": drain_seconds,
        },
    }
    phase["launcher_log_problems"] = server.log_problems(log_offset)
    say(
        f"phase {name}: held {held}/{connections}, p50 {fmt(phase['rtt_ms'].get('p50'))} ms, "
        f"p99 {fmt(phase['rtt_ms'].get('p99'))} ms over {phase['rtt_ms']['count']} heartbeats, "
        f"server RSS {phase['server_rss_steady_mb']:.0f} MB, presence entries left after disconnect: "
        f"{phase['mass_disconnect']['presence_conn_left']}"
    )
    return phase


def render_table(phases: list[dict]) -> str:
    header = (
        "| phase | connections target | held | failed (handshake / closed later / lost beats) | heartbeats | "
        "p50 ms | p99 ms | server RSS MB (idle -> steady) | KB/connection | server CPU % | "
        "celery worker CPU % | generator CPU % | machine CPU % |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for p in phases:
        lines.append(
            "| {phase} | {target:,} | {held:,} | {hf} / {dr} / {lost} | {beats:,} | {p50} | {p99} | {idle} -> {steady} "
            "| {kb} | {cpu} | {celery} | {gen} | {machine} |".format(
                phase=p["phase"],
                target=p["target"],
                held=p["held"],
                hf=p["handshake_failed"],
                dr=p["dropped"],
                lost=p["lost_heartbeats"],
                beats=p["rtt_ms"]["count"],
                p50=fmt(p["rtt_ms"].get("p50"), 2),
                p99=fmt(p["rtt_ms"].get("p99"), 2),
                idle=fmt(p["server_rss_idle_mb"], 0),
                steady=fmt(p["server_rss_steady_mb"], 0),
                kb=fmt(p["kb_per_connection"], 1),
                cpu=fmt(p["server_cpu_percent_of_core"], 1),
                celery=fmt(p["celery_worker_cpu_percent_of_core"], 1),
                gen=fmt(p["generator_cpu_percent_of_core"], 1),
                machine=fmt(p["machine_cpu_percent_of_all_cores"], 1),
            )
        )
    return "\n".join(lines)


def render_details(phases: list[dict]) -> str:
    def each(values, digits=1):
        return ", ".join(fmt(v, digits) for v in values)

    lines = []
    for p in phases:
        gens = p["generators"]
        rc = p["ramp_cpu"]
        md = p["mass_disconnect"]
        workers = "; ".join(
            f"pid {w['pid']} {w['established']} sockets, {w['rss_mb']:.0f} MB, {w['cpu_percent']:.1f}% CPU"
            for w in p["web_workers"]
        )
        lines += [
            f"- **{p['phase']}**",
            f"  - ramp: {p['ramp_seconds']:.1f} s ({fmt(p['ramp_rate_achieved'], 0)} connections/s achieved); "
            f"handshake p50 {each(g['handshake_ms'].get('p50') for g in gens)} ms, p99 "
            f"{each(g['handshake_ms'].get('p99') for g in gens)} ms (per generator; of which hello -> welcome p99 "
            f"{each(g['hello_ms'].get('p99') for g in gens)} ms); CPU during the ramp: server "
            f"{rc['server_cpu_percent_of_core']:.0f}%, generators {rc['generator_cpu_percent_of_core']:.0f}%, "
            f"machine {rc['machine_cpu_percent_of_all_cores']:.0f}% of all cores",
            f"  - steady state: {p['window_seconds']:.0f} s, RTT p90 {fmt(p['rtt_ms'].get('p90'), 2)} ms, p99.9 "
            f"{fmt(p['rtt_ms'].get('p999'), 2)} ms, max {fmt(p['rtt_ms'].get('max'), 2)} ms; generator loop lag "
            f"p99 {each((g['loop_lag_ms'].get('p99') for g in gens), 2)} ms, longest generator GC pause "
            f"{each((g['gc_pauses_ms'].get('max') for g in gens), 2)} ms",
            f"  - uvicorn workers: {workers}; presence entries in Redis {p['presence_conn_steady']}",
            f"  - all sockets dropped at once: {md['closed']} closed by the clients in "
            f"{md['client_close_seconds']:.1f} s; presence entries left in Redis after "
            f"{md['waited_seconds']:.0f} s: {md['presence_conn_left']}",
            f"  - launcher log during the phase: {p['launcher_log_problems']['lines']} warning/error lines"
            + (f"; failures {p['failure_reasons']}" if p["failure_reasons"] else "")
            + (f"; close codes {p['close_codes']}" if p["close_codes"] else ""),
        ]
    return "\n".join(lines)
