"""``dpool-workers``: the command line that starts, lists, inspects and stops daemon pools.

::

    dpool-workers start  [--name NAME] [--device-ids cpu,cpu] [--threads N] [--foreground] [--listen [HOST:]PORT]
    dpool-workers list   [--json]
    dpool-workers status [--name NAME] [--json]          (no --name: the one running pool)
    dpool-workers stop   [--name NAME] [--timeout S]     (no --name: the one running pool)
    dpool-workers doctor [--json]                        (the environment check: see dpool_workers.doctor)
    dpool-workers --version

Exit codes: 0 success; 1 error (e.g. start failed, daemon unresponsive, a doctor check failed); 2 usage
error; 3 no pool of that name is running (status, stop); 4 a pool of that name is already running (start).

The daemon itself (its files, sessions and lifecycle) is :mod:`dpool_workers.daemon`; ``start``
runs it in the background as ``cli start --foreground``.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any

from importlib.metadata import PackageNotFoundError, version

import dpool
from dpool import protocol as P
from dpool.cpus import physical_cores
from dpool.daemon_client import POOL_FILES, lock_held, pool_dir, read_pool, request, running_pools
from dpool.launch import worker_command

from .daemon import EXIT_ALREADY_RUNNING, EXIT_ERROR, EXIT_NOT_RUNNING, EXIT_OK, EXIT_USAGE, Daemon

__all__ = ["main", "parse_listen"]


def parse_listen(text: str) -> str:
    """``PORT`` or ``HOST:PORT`` (HOST defaults to 127.0.0.1) → a ``tcp://`` endpoint."""
    host, _, port = text.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--listen {text!r}: expected PORT or HOST:PORT (PORT 0 picks a free port)")
    return f"tcp://[{host}]:{int(port)}" if ":" in host else f"tcp://{host}:{int(port)}"


def _devices(text: str | None) -> list[str]:
    parts = [t.strip() for t in (text or "").split(",") if t.strip()]
    if parts and all(p == "cpu" for p in parts):
        return parts  # without importing torch here (seconds): the daemon process imports it anyway
    from dpool.devices import parse_devices

    if not text:
        return parse_devices(None)
    return parse_devices([int(t) if t.strip().isdigit() else t.strip() for t in text.split(",")])


def cmd_start(a: argparse.Namespace) -> int:
    try:
        listen = parse_listen(a.listen) if a.listen is not None else None
    except ValueError as exc:
        print(f"dpool-workers: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:  # wrap()'s rules (dpool.devices), before anything is created
        devices = _devices(a.device_ids)
        if any(d != "cpu" for d in devices):
            from dpool.devices import check_devices  # (imports torch: only for GPU pools)

            check_devices(devices)
    except (ValueError, TypeError) as exc:  # DpoolValueError, DpoolTypeError
        print(f"dpool-workers: {exc}", file=sys.stderr)
        return EXIT_USAGE
    path = pool_dir(a.name, create=True)
    if lock_held(path):
        pid = "?"
        try:
            pid = json.load(open(os.path.join(path, "state.json")))["pid"]
        except Exception:
            pass
        print(f"dpool-workers: a pool named {a.name!r} is already running (pid {pid}); "
              f"stop it with: dpool-workers stop --name {a.name}", file=sys.stderr)
        return EXIT_ALREADY_RUNNING
    threads = a.threads or max(1, physical_cores() // len(devices))
    for stale in ("state.json", "daemon.sock", "key"):  # a crashed daemon's leftovers (no daemon holds the lock)
        try:
            os.unlink(os.path.join(path, stale))
        except FileNotFoundError:
            pass
    if a.foreground:
        return Daemon(a.name, devices, threads, listen).run()
    log = open(os.path.join(path, "daemon.log"), "ab")
    extra = ["--listen", a.listen] if a.listen is not None else []
    proc = subprocess.Popen([*worker_command("cli"), "start", "--name", a.name, "--device-ids",
                             ",".join(devices), "--threads", str(threads), "--foreground", *extra],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    deadline = time.time() + a.timeout
    state_path = os.path.join(path, "state.json")
    shown = -1
    while time.time() < deadline:
        if proc.poll() is not None:
            print(f"dpool-workers: the daemon exited with code {proc.returncode} while starting; "
                  f"see {os.path.join(path, 'daemon.log')}", file=sys.stderr)
            return EXIT_ALREADY_RUNNING if proc.returncode == EXIT_ALREADY_RUNNING else EXIT_ERROR
        if _state_pid(state_path) == proc.pid:
            where = ""
            if listen is not None:
                with open(state_path) as f:
                    where = f"; listening on {json.load(f)['listen']} (clients need DPOOL_KEY_FILE={path}/key)"
            print(f"dpool-workers: pool {a.name!r} ready: {len(devices)} workers on {','.join(devices)} "
                  f"(daemon pid {proc.pid}){where}", file=sys.stderr)
            return EXIT_OK
        elapsed = int(time.time() - (deadline - a.timeout))
        if elapsed != shown:
            print(f"dpool-workers: starting {len(devices)} workers… {elapsed}s", file=sys.stderr, flush=True)
            shown = elapsed
        time.sleep(0.05)
    proc.kill()
    print(f"dpool-workers: workers not ready within {a.timeout:g}s; see {path}/daemon.log", file=sys.stderr)
    return EXIT_ERROR


def _state_pid(path: str) -> int:
    try:
        with open(path) as f:
            return int(json.load(f)["pid"])
    except (OSError, ValueError, KeyError):
        return -1


def _version() -> str:
    try:
        return version("dpool")
    except PackageNotFoundError:  # a source checkout used without installing it
        return dpool.__version__


def cmd_list(a: argparse.Namespace) -> int:
    rows = []
    for name in running_pools():
        row: dict[str, Any] = {"name": name, "devices": [], "state": "unresponsive", "client_pid": None,
                               "uptime_s": None, "pid": None}
        try:
            state, _ = read_pool(name)
            row["devices"], row["pid"] = state["devices"], state["pid"]
            row["uptime_s"] = round(time.time() - state["started"], 1)
            info = request(name, P.Status(), timeout=2.0).info
            states = {w["state"] for w in info["workers"]}
            row["client_pid"] = info["client_pid"]
            row["state"] = ("attached" if info["client_pid"] is not None
                            else "idle" if states == {"idle"} else ",".join(sorted(states)))
        except (OSError, ValueError, TimeoutError):
            pass  # starting (no state file yet) or not answering: shown as unresponsive
        rows.append(row)
    if a.json:
        print(json.dumps(rows))
        return EXIT_OK
    print(f"{'name':<16} {'devices':<24} {'state':<12} {'client':>8} {'uptime s':>9}")
    for r in rows:
        print(f"{r['name']:<16} {','.join(r['devices']):<24} {r['state']:<12} {str(r['client_pid'] or '-'):>8} "
              f"{r['uptime_s'] if r['uptime_s'] is not None else '-':>9}")
    return EXIT_OK


def cmd_status(a: argparse.Namespace) -> int:
    try:
        reply = request(a.name, P.Status(), timeout=a.timeout)
    except FileNotFoundError as exc:
        print(f"dpool-workers: {exc}", file=sys.stderr)
        return EXIT_NOT_RUNNING
    except TimeoutError as exc:
        print(f"dpool-workers: {exc}", file=sys.stderr)
        return EXIT_ERROR
    info = reply.info
    if a.json:
        print(json.dumps(info))
        return EXIT_OK
    client = info["client_pid"] if info["client_pid"] is not None else "none"
    listening = f", listening on {info['listen']}" if info.get("listen") else ""
    print(f"pool {info['name']} (daemon pid {info['pid']}): client {client}, steps served {info['steps_served']}"
          f"{listening}")
    print(f"{'index':>5} {'device':>6} {'pid':>8} {'state':>8} {'rss MiB':>8} {'uptime s':>9} {'restarts':>8}")
    for w in info["workers"]:
        print(f"{w['index']:>5} {w['device']:>6} {w['pid']:>8} {w['state']:>8} {w['rss_bytes'] / 2**20:>8.1f} "
              f"{w['uptime_s']:>9.1f} {w['restarts']:>8}")
    return EXIT_OK


def cmd_stop(a: argparse.Namespace) -> int:
    path = pool_dir(a.name)
    try:
        state, _ = read_pool(a.name)
    except FileNotFoundError as exc:
        print(f"dpool-workers: {exc}", file=sys.stderr)
        return EXIT_NOT_RUNNING
    pid = state["pid"]
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return EXIT_NOT_RUNNING
    try:
        try:
            request(a.name, P.Stop(), timeout=min(2.0, a.timeout))
        except (TimeoutError, FileNotFoundError):
            pass
        for sig in (None, signal.SIGTERM, signal.SIGKILL):  # graceful, then escalate
            if sig is not None:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    break
            if select.select([fd], [], [], a.timeout * (0.8 if sig is None else 0.5))[0]:
                break
    finally:
        os.close(fd)
    if not lock_held(path):  # in case the daemon had to be killed: remove what it left
        for f in POOL_FILES:
            try:
                os.unlink(os.path.join(path, f))
            except FileNotFoundError:
                pass
        try:
            os.rmdir(path)
        except OSError:
            pass
    print(f"dpool-workers: pool {a.name!r} stopped", file=sys.stderr)
    return EXIT_OK


def cmd_doctor(a: argparse.Namespace) -> int:
    from . import doctor  # (imports torch)

    return doctor.main(a.json)


def parser() -> argparse.ArgumentParser:
    """The command line's parser (the docs site prints its help)."""
    ap = argparse.ArgumentParser(prog="dpool-workers", description="Warm dpool worker pools that training "
                                 "scripts attach to with dpool.wrap(net, pool=NAME) or DPOOL_POOL=NAME.",
                                 epilog="exit codes: 0 ok, 1 error, 2 usage, 3 not running, 4 already running")
    ap.add_argument("--version", action="version", version=f"dpool-workers {_version()}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start", help="start a pool and wait until every worker is ready")
    s.add_argument("--name", default="default")
    s.add_argument("--device-ids", help="comma-separated: cpu,cpu or GPU indices such as 0,1 or 0,0 (two workers on "
                   "GPU 0); default: one CPU worker per physical core")
    s.add_argument("--threads", type=int, default=0, help="torch threads per worker (default: cores / workers)")
    s.add_argument("--foreground", action="store_true", help="run the daemon in this process")
    s.add_argument("--listen", metavar="[HOST:]PORT",
                   help="also accept clients over TCP (HOST defaults to 127.0.0.1; PORT 0 picks a free one). "
                        "Authenticated with the pool key; clients attach with pool='tcp://HOST:PORT' and "
                        "DPOOL_KEY_FILE. Off by default: without it no TCP socket is opened")
    s.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the workers")
    s.set_defaults(func=cmd_start)
    ls = sub.add_parser("list", help="every running pool of this user: name, devices, state, client, uptime")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_list)
    st = sub.add_parser("status", help="show the workers, the attached client and the steps served")
    st.add_argument("--name", default=None, help="default: the one running pool")
    st.add_argument("--json", action="store_true")
    st.add_argument("--timeout", type=float, default=5.0)
    st.set_defaults(func=cmd_status)
    sp = sub.add_parser("stop", help="stop a pool (graceful, then SIGTERM, then SIGKILL)")
    sp.add_argument("--name", default=None, help="default: the one running pool")
    sp.add_argument("--timeout", type=float, default=10.0)
    sp.set_defaults(func=cmd_stop)
    dr = sub.add_parser("doctor", help="check this machine for dpool (each finding OK, WARN or FAIL with what to "
                        "do) and run a 2-worker training step; exits 1 on a FAIL")
    dr.add_argument("--json", action="store_true")
    dr.set_defaults(func=cmd_doctor)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if getattr(a, "name", "") is None:  # status / stop without --name: the one running pool, if just one runs
        names = running_pools()
        if len(names) != 1:
            print("dpool-workers: " + (f"{len(names)} pools are running ({', '.join(names)}); name one with --name"
                                       if names else "no pool is running"), file=sys.stderr)
            return EXIT_USAGE if names else EXIT_NOT_RUNNING
        a.name = names[0]
    try:
        return a.func(a)
    except (ValueError, PermissionError) as exc:
        print(f"dpool-workers: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
