"""The peers run: python -m benchmarks.peers [--full] [--scale X] [--sides a,b] [--out PATH].

Run by scripts/bench-peers.sh (`make bench-peers`) with .venv's Python, REDIS_URL and
DATABASE_URL (Backlot's database) and PEERS_REDIS_URL, PEERS_PROCRASTINATE_URL,
PEERS_DJTASKS_URL set. Three rounds; in each, every side runs its four cases once (Backlot in
.venv, each peer in .data/venv-peers), the order reversed every other round, so a load that
comes and goes on this shared machine falls on every side alike; a ratio is taken per round
(both figures of the same round), then its median over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import summary
from benchmarks.peers.common import ROOT, SMALL, log, peer_python, sizes

RESULTS = ROOT / "benchmarks" / "results"
SIDES = [
    "backlot",  # both Backlot variants, one process
    "dramatiq",
    "rq",
    "huey",
    "procrastinate",
    "django_tasks_db",
]
CASES = ("enqueue", "bulk", "drain", "latency_p50")
LABELS = {
    "enqueue": "single enqueue jobs/s",
    "bulk": "bulk enqueue jobs/s",
    "drain": "drain jobs/s",
    "latency_p50": "latency p50 ms",
}
ON, OFF = "backlot_ledger_on", "backlot_ledger_off"


def call(argv: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        out = fh.name
    child = subprocess.Popen([*argv, out], cwd=ROOT, env=env, start_new_session=True)
    try:
        child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, 15)  # SIGTERM: its `finally` blocks stop the workers it started
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, 9)
            child.wait()
        Path(out).unlink(missing_ok=True)
        return {"error": f"timed out after {timeout:.0f}s"}
    try:
        data: dict[str, Any] = json.loads(Path(out).read_text() or "{}")
    except (OSError, ValueError):
        data = {}
    Path(out).unlink(missing_ok=True)
    return data or {"error": f"exited {child.returncode} without results"}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers")
    parser.add_argument("--full", action="store_true", help="larger sizes (FULL in common.py)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every count")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--out", default=str(RESULTS / "peers.json"))
    opts = parser.parse_args()
    sides = [s for s in opts.sides.split(",") if s]
    unknown = set(sides) - set(SIDES)
    if unknown:
        parser.error(f"unknown side(s): {', '.join(sorted(unknown))}")

    from benchmarks.__main__ import child_env, machine_meta, migrate, reset_services

    began = time.monotonic()
    env = child_env(os.environ["DATABASE_URL"])
    env["PEERS_SCALE"] = str(opts.scale)
    env["PATH"] = env.get("PATH", "") + os.pathsep + str(Path(peer_python()).parent)  # py-spy
    log("migrating Backlot's database, emptying its tables and Redis")
    migrate(env)
    reset_services(env)
    meta = machine_meta()
    size = sizes(opts.full)
    meta.update(sizes=size.__dict__, scale=opts.scale, full=opts.full)
    flag = ["--full"] if opts.full else []
    timeout = 900.0 * (20 if opts.full else 1)

    per_round: dict[str, dict[str, list[float]]] = {}
    info: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for round_no in range(SMALL.rounds):
        order = sides if round_no % 2 == 0 else sides[::-1]
        for side in order:
            log(f"round {round_no + 1}/{SMALL.rounds}: {side}")
            run_env = {**env, "PEERS_ROUND": str(round_no)}
            if side == "backlot":
                argv = [sys.executable, "-m", "benchmarks.peers.backlot", "--per-round", *flag]
                got = call(argv, run_env, timeout)
                parts = {k: v for k, v in got.items() if k in (ON, OFF)}
                if "error" in got and not parts:
                    parts = {ON: got, OFF: got}
            else:
                argv = [peer_python(), "-m", "benchmarks.peers.peer", side, "--per-round", *flag]
                parts = {side: call(argv, run_env, timeout)}
            for name, data in parts.items():
                if "error" in data:
                    errors.setdefault(name, data["error"])
                    log(f"{name} FAILED in round {round_no + 1}:\n{data['error']}")
                    continue
                info[name] = {k: v for k, v in data.items() if k != "figures"}
                for case, figure in data["figures"].items():
                    value = figure["p50_all"] if case == "latency_p50" else figure["median"]
                    per_round.setdefault(name, {}).setdefault(case, []).append(value)

    profile: dict[str, Any] = {}
    if "backlot" in sides and not opts.no_profile:
        log("profile: py-spy over the shipped workers in a ledger-off drain")
        path = RESULTS / "peers-profile.txt"
        argv = [sys.executable, "-m", "benchmarks.peers.backlot", "--per-round", "--cases"]
        argv += ["none", "--profile", str(path), *flag]
        profile = call(argv, env, timeout).get("profile", {"error": "no profile"})

    document = build(per_round, info, errors, profile, meta)
    document["meta"]["total_seconds"] = round(time.monotonic() - began, 1)
    document["meta"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(document, indent=1) + "\n")
    print(render(document), flush=True)
    print(
        f"\ntotal {document['meta']['total_seconds'] / 60:.1f} min; results in {opts.out}",
        flush=True,
    )
    return 1 if errors else 0


def _ratio(a: list[float], b: list[float]) -> dict[str, Any] | None:
    pairs = [(x, y) for x, y in zip(a, b, strict=False) if y]
    if not pairs:
        return None
    return summary([x / y for x, y in pairs])


def build(
    per_round: dict[str, dict[str, list[float]]],
    info: dict[str, Any],
    errors: dict[str, str],
    profile: dict[str, Any],
    meta: dict[str, Any],
) -> dict[str, Any]:
    sides: dict[str, Any] = {}
    for name, cases in per_round.items():
        sides[name] = {
            **info.get(name, {}),
            "figures": {case: summary(values) for case, values in cases.items()},
            # Backlot / this side, per round (latency: this side / Backlot, so > 1 = Backlot
            # is faster in every column).
            "backlot_ratios": {},
        }
        for ref in (OFF, ON):
            if ref not in per_round or name in (OFF, ON):
                continue
            mine, theirs = per_round[name], per_round[ref]
            out = {}
            for case in CASES:
                if case in mine and case in theirs:
                    if case == "latency_p50":
                        r = _ratio(mine[case], theirs[case])
                    else:
                        r = _ratio(theirs[case], mine[case])
                    if r:
                        out[case] = round(r["median"], 3)
            sides[name]["backlot_ratios"][ref] = out
    for name, error in errors.items():
        sides.setdefault(name, {})["error"] = error

    targets = []

    def target(name: str, ref: str, peer: str, case: str) -> None:
        ratio = sides.get(peer, {}).get("backlot_ratios", {}).get(ref, {}).get(case)
        if ratio is None:
            targets.append({"target": name, "measured": None, "goal": ">= 1.0", "met": False})
            return
        targets.append({"target": name, "measured": ratio, "goal": ">= 1.0", "met": ratio >= 1.0})

    for peer in ("procrastinate", "django_tasks_db"):
        for case in ("drain", "enqueue"):
            target(f"Backlot ledger-on / {peer}, {case}", ON, peer, case)
    for case in ("drain", "enqueue", "bulk"):
        target(f"Backlot ledger-off / rq, {case}", OFF, "rq", case)
    reported = sides.get("dramatiq", {}).get("backlot_ratios", {}).get(OFF, {})
    return {
        "meta": meta,
        "sides": sides,
        "targets": targets,
        "dramatiq_ratio_ledger_off": reported,
        "profile": profile,
    }


def render(document: dict[str, Any]) -> str:
    sides = document["sides"]
    head = f"{'side':<20}" + "".join(f"{LABELS[c]:>24}" for c in CASES)
    lines = ["", "Peers (median of 3 rounds; one run)", head, "-" * len(head)]
    for name, side in sides.items():
        if "figures" not in side:
            lines.append(f"{name:<20}  FAILED: {side.get('error', '')[-200:].splitlines()[-1:]}")
            continue
        cells = []
        for case in CASES:
            fig = side["figures"].get(case)
            if fig is None:
                cells.append(f"{'-':>24}")
                continue
            fmt = f"{fig['median']:,.2f}" if case == "latency_p50" else f"{fig['median']:,.0f}"
            spread = f" ±{fig['spread_pct']:.0f}%"
            cells.append(f"{fmt + spread:>24}")
        lines.append(f"{name:<20}" + "".join(cells))
    lines += ["", "Backlot / peer, per-round ratios' median (latency: peer / Backlot; > 1: Backlot"]
    lines += ["is faster)", f"{'peer':<20}{'vs':<12}" + "".join(f"{c:>14}" for c in CASES)]
    for name, side in sides.items():
        for ref, ratios in side.get("backlot_ratios", {}).items():
            cells = [f"{ratios[c]:>14.2f}" if c in ratios else f"{'-':>14}" for c in CASES]
            lines.append(f"{name:<20}{ref.removeprefix('backlot_'):<12}" + "".join(cells))
    lines += ["", "Targets"]
    for t in document["targets"]:
        measured = "-" if t["measured"] is None else f"{t['measured']:.2f}"
        mark = "met" if t["met"] else "NOT met"
        lines.append(f"  {t['target']:<45} {measured:>6} {t['goal']:<8} {mark}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
