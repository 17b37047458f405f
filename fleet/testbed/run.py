"""``fleet testbed``: the fleet on emulated devices, in real time, through Flower's real deployment.

One real ``flower-superlink`` runs in the server's namespace; every device is a real
``flower-supernode`` in its own cgroup (CPU quota, memory limit) and network namespace (shaped
uplink and downlink), reading its own ImageFolder tree and profiling itself under its limits on
its first query, as a device in the field would. ``flwr run`` submits the app; the testbed
watches the run's metrics.jsonl, prints one line per round, replays faults at their rounds, and
removes every process, cgroup and namespace it made on every way out.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from fleet.base.errors import ConfigError, FleetError
from fleet.engine.config import config_to_dict
from fleet.engine.experiment import check_model_fits_data, load_data
from fleet.federated.on_server.state import keep_previous_run
from fleet.federated.on_server.tracking import read_progress, read_records
from fleet.federated.on_server.wall import Lap
from fleet.federated.shared.config import run_dir
from fleet.federated.shared.paths import APP_ROOT
from fleet.federated.shared.round_record import RoundRecord
from fleet.federated.shared.run_summary import SUMMARY_FILE, RunSummary
from fleet.testbed import cgroup, network
from fleet.testbed.calibrate import calibrate_classes, class_profiles
from fleet.testbed.config import TestbedClassConfig, TestbedFleetConfig
from fleet.testbed.data import class_names, write_device_trees

BIN = Path(sys.executable).parent  # flower-superlink, flower-supernode and flwr of this environment
PORT = 9092  # the SuperLink's one HTTP port (Fleet, Control and Runtime APIs), in the server's own namespace
POLL_S = 0.5
Log = Callable[[str], None]


@dataclass(frozen=True)
class Fault:
    """A fault replayed in real time: ``kill`` or ``freeze`` a device when ``round`` starts, or let it ``join``."""

    kind: str  # kill | freeze | join
    device: str
    round: int
    seconds: float = 0.0  # freeze: how long

    @classmethod
    def parse(cls, kind: str, text: str) -> Fault:
        """``NAME@ROUND`` (kill, join) or ``NAME@ROUND:SECONDS`` (freeze); a one-line error otherwise."""
        form, example = ("NAME@ROUND:SECONDS", "pi4-0@3:30") if kind == "freeze" else ("NAME@ROUND", "pi4-0@3")
        name, _, rest = text.partition("@")
        rnd, _, secs = rest.partition(":")
        try:
            fault = cls(kind, name, int(rnd), float(secs) if kind == "freeze" else 0.0)
        except ValueError:
            raise ConfigError(f"--{kind} {text}: write it as {form}, e.g. {example}") from None
        if not name or fault.round < 1 or (kind == "freeze" and not fault.seconds > 0):
            raise ConfigError(f"--{kind} {text}: write it as {form} with a device name, a round >= 1 (and seconds > 0)")
        return fault


@dataclass
class Device:
    """One emulated device: its class, its limits, its link, and its SuperNode once started."""

    name: str
    index: int
    cls: TestbedClassConfig
    tree: Path
    cgroup: cgroup.Cgroup | None = None
    link: network.Link | None = None
    proc: subprocess.Popen | None = None

    def node_config(self, runtime_mb: float) -> str:
        parts = [f"device-name='{self.name}'", f"data-root='{self.tree}'", f"threads={self.cls.threads()}"]
        parts.append(f"uplink-mbps={self.cls.uplink_mbps:g}")  # as an operator who knows the device's link
        if self.cls.memory_mb is not None:
            parts.append(f"memory-budget-mb={self.cls.memory_mb - runtime_mb:g}")
        return " ".join(parts)


def device_names(cfg: TestbedFleetConfig) -> list[tuple[str, TestbedClassConfig]]:
    """Every device of the testbed, named <class>-<k>, class by class."""
    return [(f"{c.name}-{k}", c) for c in cfg.testbed.classes for k in range(c.count)]


def check_requirements(cfg: TestbedFleetConfig) -> None:
    """One line naming what this machine lacks for the testbed, before anything is made."""
    if not cfg.testbed.classes:
        raise ConfigError("testbed.classes: none; list the kinds of device to emulate (docs/testbed.md)")
    class_profiles(cfg)
    if os.geteuid() != 0:
        raise FleetError("the testbed needs root (cgroups and network namespaces); run it as root, e.g. with sudo")
    cgroup.version()
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise FleetError(f"the testbed needs iproute2's `{tool}`; install it (apt-get install iproute2)")
    if any(c.latency_ms > 0 for c in cfg.testbed.classes) and not network.has_netem():
        raise FleetError(
            "testbed.classes: latency_ms needs the kernel's netem qdisc (sch_netem), which this kernel lacks; "
            "set latency_ms: 0, or load the module (modprobe sch_netem)"
        )


def remove_stale(log: Log) -> None:
    """Whatever an earlier testbed left behind (a crash, a kill -9): its processes, namespaces and cgroups."""
    for ns in [n for n in network.namespaces() if n.startswith(network.PREFIX)]:
        for pid in network.run("ip", "netns", "pids", ns).split():
            _kill(int(pid))
    gone = network.remove_stale() + cgroup.remove_stale()
    if gone:
        log(f"removed what an earlier testbed left behind: {', '.join(sorted(set(gone)))}")


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Testbed:
    """The emulated fleet of one run: start it, submit the app, watch it, and always tear it down.

    Use it as a context manager: leaving the block (normally, on Ctrl-C, on an error) removes every
    process, cgroup and namespace it made."""

    def __init__(self, cfg: TestbedFleetConfig, work: Path, log: Log = print) -> None:
        self.cfg, self.work, self.log = cfg, work, log
        self.home = work / "flwr-home"
        self.devices = [Device(n, i, c, work / "data" / n) for i, (n, c) in enumerate(device_names(cfg))]
        self.procs: list[subprocess.Popen] = []
        self.env = {
            **os.environ,
            "FLWR_HOME": str(self.home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")]),
            "PYTHONUNBUFFERED": "1",
        }

    def __enter__(self) -> Testbed:
        remove_stale(self.log)
        self._previous_handlers = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
        try:
            self._start_link()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start_link(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "testbed"\n\n[superlink.testbed]\naddress = "127.0.0.1:{PORT}"\ninsecure = true\n'
        )
        network.create_server_namespace()
        args = [str(BIN / "flower-superlink"), "--insecure", "--disable-runtime-dependency-installation"]
        args += ["--host", "0.0.0.0", "--port", str(PORT)]  # every device dials it over its own link
        self.link_proc = self._spawn("superlink", ["ip", "netns", "exec", network.SERVER_NS, *args])
        self._wait_port(network.SERVER_NS, PORT, self.link_proc, "superlink")

    def start_device(self, device: Device) -> None:
        """Its cgroup and link, then its SuperNode inside both, dialling the SuperLink over its link."""
        c = device.cls
        device.cgroup = cgroup.Cgroup(device.name, c.cpu, c.memory_mb).create()
        device.link = network.Link(device.name, device.index, c.uplink_mbps, c.downlink_mbps, c.latency_ms).create()
        warm = self.cfg.testbed.runtime == "warm"
        # warm: a device as docs/pi.md sets it up (Flower's SuperNode without its idle sleeps, tasks served by
        # the warm runtime); subprocess: Flower's own flower-supernode, unchanged, to compare against
        node = [str(BIN / "fleet"), "device", "supernode", "--"] if warm else [str(BIN / "flower-supernode")]
        node += ["--insecure", "--superlink", f"{device.link.server_address}:{PORT}"]
        node += ["--node-config", device.node_config(self.cfg.testbed.runtime_mb)]
        inside = device.cgroup.join_command() + device.link.exec_prefix()  # its cgroup, then its namespace
        device.proc = self._spawn(device.name, inside + node + (["--isolation", "process"] if warm else []))
        if warm:  # the device's runtime serves the SuperNode's Runtime API on the namespace's own loopback
            runtime = [str(BIN / "fleet"), "device", "runtime", "--insecure", "--parent-pid", str(device.proc.pid)]
            self._spawn(f"{device.name}-runtime", inside + runtime)

    def submit(self, config_path: Path) -> None:
        """``flwr run`` the app with ``config_path`` from the server's namespace."""
        cmd = ["ip", "netns", "exec", network.SERVER_NS, str(BIN / "flwr"), "run", str(APP_ROOT), "testbed"]
        cmd += ["--run-config", f"config='{config_path}'"]
        done = subprocess.run(cmd, env=self.env, cwd=APP_ROOT, capture_output=True, text=True, timeout=300)
        if done.returncode != 0 or "Successfully started run" not in done.stdout:
            raise FleetError(f"flwr run did not start the run: {(done.stdout + done.stderr).strip()[-500:]}")

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log_path = self.work / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("a") as fh:
            proc = subprocess.Popen(
                cmd, env=self.env, cwd=self.work, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs.append(proc)
        return proc

    def _wait_port(self, ns: str, port: int, proc: subprocess.Popen, name: str, timeout_s: float = 60) -> None:
        probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), 1)"
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if proc.poll() is not None:
                tail = (self.work / "logs" / f"{name}.log").read_text()[-800:]
                raise FleetError(f"the {name} exited at start ({proc.returncode}): {tail}")
            done = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", probe], capture_output=True)
            if done.returncode == 0:
                return
            time.sleep(0.5)
        raise FleetError(f"the {name} did not open port {port} within {timeout_s:.0f}s; see {self.work / 'logs'}")

    def close(self) -> None:
        """Every process, cgroup and namespace of this testbed, gone (also after a partial start)."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for device in self.devices:
            if device.cgroup is not None:
                device.cgroup.remove()
            if device.link is not None:
                device.link.remove()
        remove_stale(lambda line: None)  # the server's namespace, and anything a half-made device left
        for sig, handler in getattr(self, "_previous_handlers", {}).items():
            signal.signal(sig, handler)

    # --- faults --------------------------------------------------------------------------------
    def device(self, name: str) -> Device:
        found = next((d for d in self.devices if d.name == name), None)
        if found is None:
            names = ", ".join(d.name for d in self.devices)
            raise ConfigError(f"no testbed device is called {name!r}; the devices are {names}")
        return found

    def kill(self, device: Device) -> None:
        """Dead: every process of the device killed, and it stays down."""
        if device.cgroup is not None:
            for pid in device.cgroup.pids():
                _kill(pid)

    def freeze(self, device: Device, seconds: float) -> float:
        """Alive but silent for ``seconds`` (its processes stopped); returns when to thaw it (monotonic)."""
        if device.cgroup is not None:
            device.cgroup.freeze(True)
        return time.monotonic() + seconds


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def prepare_run(cfg: TestbedFleetConfig, work: Path, joining: set[str], log: Log) -> tuple[TestbedFleetConfig, Path]:
    """The deployed fleet's config: one device per testbed device, each reading its own tree, each
    profiling itself (no shared profile), the start pretrained on held-out samples; written next to the
    run as fleet-config.yaml. Writes every device's tree."""
    check_model_fits_data(cfg, *load_data(cfg.data, cfg.train.seed))
    names = [n for n, _ in device_names(cfg)]
    cfg = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, class_names=class_names(cfg)),
        devices=dataclasses.replace(cfg.devices, num_devices=len(names), newcomers=0),
        membership=dataclasses.replace(cfg.membership, min_devices=len(names) - len(joining)),
        hardware=dataclasses.replace(cfg.hardware, profile=None),
    )
    out = run_dir(cfg)
    keep_previous_run(out, cfg.name, log)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.replace(cfg, output_dir=str(out.parent))
    if cfg.start.samples > 0 and cfg.model.weights is None:
        from fleet.federated.launch.pretrain import pretrain_fleet_model

        ckpt = pretrain_fleet_model(cfg, out / "pretrained.pt", log)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, weights=str(ckpt)))
    write_device_trees(cfg, names, work / "data")
    path = out / "fleet-config.yaml"
    path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    return cfg, path


def class_round_times(rec: RoundRecord, classes: dict[str, str]) -> dict[str, float]:
    """Per class, its slowest device's real round this round: the server's wall seconds from sending the
    train message to pulling the reply (start, transfers and compute together)."""
    out: dict[str, float] = {}
    for d in rec.devices:
        cls = classes.get(d.device or "")
        if cls is not None and d.wall_s is not None:
            out[cls] = max(out.get(cls, 0.0), float(d.wall_s))
    return out


def progress_line(rec: RoundRecord, rounds: int, wall_s: float, classes: dict[str, str]) -> str:
    def pct(v: object) -> str:
        return f"{100 * v:5.1f}%" if isinstance(v, (int, float)) else "  n/a "

    times = "  ".join(f"{c} {t:.1f}s" for c, t in sorted(class_round_times(rec, classes).items()))
    missed = f"  missed {','.join(rec.missed)}" if rec.missed else ""
    return (
        f"round {rec.round:>3}/{rounds}  wall {wall_s:7.1f}s  global {pct(rec.global_accuracy)}  "
        f"personal {pct(rec.personal_accuracy)}  {times}{missed}"
    )


def assembly_s(records: list[RoundRecord]) -> float:
    """How long the first round waited for the fleet to assemble: every device's answer to its first query (its
    data loaded, its profiles measured), its opening lap. A device measures its profiles once, not once per
    run of a job, so a bench's clock starts after it (fleet.bench.testbed.from_assembly)."""
    first = records[0] if records and records[0].round == 1 else None
    return 0.0 if first is None else first.server_s.get(Lap.OPEN, 0.0)


def watch(
    tb: Testbed, out: Path, faults: list[Fault], log: Log, stop_after_s: float | None = None
) -> list[RoundRecord]:
    """Print a line per round as the run writes metrics.jsonl, replay each fault when its round starts,
    and return the records once summary.json is written, or once a round ends past ``stop_after_s`` of
    the run's wall clock since the fleet assembled (a bench's budget); a FleetError past testbed.timeout_s."""
    cfg = tb.cfg
    classes = {d.name: d.cls.name for d in tb.devices}
    started = time.monotonic()
    end = started + cfg.testbed.timeout_s
    pending, thaw, records = sorted(faults, key=lambda f: f.round), {}, []
    while not (out / SUMMARY_FILE).is_file():
        if stop_after_s is not None and records and records[-1].wall_time_s - assembly_s(records) >= stop_after_s:
            log(f"testbed: the wall-clock budget of {stop_after_s:.0f}s is spent; stopped after round {len(records)}")
            return records
        if time.monotonic() > end:
            raise FleetError(f"the testbed run passed testbed.timeout_s ({cfg.testbed.timeout_s:.0f}s); stopped it")
        if tb.link_proc.poll() is not None:
            raise FleetError(f"the SuperLink exited ({tb.link_proc.returncode}); see {tb.work / 'logs'}")
        fresh = read_records(out)
        for rec in fresh[len(records) :]:
            log(progress_line(rec, cfg.federation.rounds, time.monotonic() - started, classes))
        records = fresh
        closed, _ = read_progress(out)  # not len(records): a pipelined round's line waits on the next round
        while pending and pending[0].round <= closed + 1:
            fault = pending.pop(0)
            thaw.update(apply_fault(tb, fault, log))
        for name, when in list(thaw.items()):
            if time.monotonic() >= when:
                tb.device(name).cgroup.freeze(False)
                log(f"testbed: {name} thawed")
                del thaw[name]
        time.sleep(POLL_S)
    final = read_records(out)
    for rec in final[len(records) :]:
        log(progress_line(rec, cfg.federation.rounds, time.monotonic() - started, classes))
    return final


def apply_fault(tb: Testbed, fault: Fault, log: Log) -> dict[str, float]:
    """Replay one fault; a freeze returns when its device thaws."""
    device = tb.device(fault.device)
    log(
        f"testbed: round {fault.round}: {fault.kind} {device.name}"
        + (f" for {fault.seconds:g}s" if fault.seconds else "")
    )
    if fault.kind == "kill":
        tb.kill(device)
    elif fault.kind == "freeze":
        return {device.name: tb.freeze(device, fault.seconds)}
    else:
        tb.start_device(device)
    return {}


@dataclass
class TestbedRun:
    """What a testbed run left: its rounds, its summary, and each device's memory."""

    __test__ = False  # not a pytest class

    records: list[RoundRecord]  # metrics.jsonl, a line per round
    summary: RunSummary | None  # summary.json; None when the run was stopped at a wall-clock budget
    memory: dict[str, tuple[float, int]]  # device -> (its cgroup's memory peak in MB, its OOM kills)
    traffic: dict[str, tuple[int, int]]  # device -> bytes its link carried (up, down), Flower's framing included
    classes: dict[str, TestbedClassConfig]  # device -> its class, as it ran (a calibrated class with its quota)
    run_dir: Path


def run_testbed(
    cfg: TestbedFleetConfig, faults: list[Fault], log: Log = print, stop_after_s: float | None = None
) -> TestbedRun:
    """Start the emulated fleet, run the app on it to the end (or until a round ends past
    ``stop_after_s`` wall seconds), tear it down."""
    names = [n for n, _ in device_names(cfg)]
    for fault in faults:  # a fault naming no device stops here, before anything is made
        if fault.device not in names:
            raise ConfigError(
                f"--{fault.kind}: no testbed device is called {fault.device!r}; the devices are {', '.join(names)}"
            )
    joining = {f.device for f in faults if f.kind == "join"}
    check_requirements(cfg)  # before the previous run's work folder is removed: a bad profile keeps its logs
    work = run_dir(cfg).parent / f"{cfg.name}-testbed"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    with Testbed(cfg, work, log) as tb:
        cfg, config_path = prepare_run(cfg, work, joining, log)
        tb.cfg = cfg = calibrate_classes(cfg, config_path, work, log)
        for device in tb.devices:
            device.cls = next(c for c in cfg.testbed.classes if c.name == device.cls.name)
        for device in tb.devices:
            if device.name not in joining:
                tb.start_device(device)
        log(f"testbed: {len(tb.devices) - len(joining)} devices started ({', '.join(_limits(tb))}); submitting")
        tb.submit(config_path)
        records = watch(tb, run_dir(cfg), faults, log, stop_after_s)
        memory, traffic = device_costs(tb, log)
        classes = {d.name: d.cls for d in tb.devices}
    summary = RunSummary.read(run_dir(cfg)) if (run_dir(cfg) / SUMMARY_FILE).is_file() else None
    return TestbedRun(records, summary, memory, traffic, classes, run_dir(cfg))


def device_costs(tb: Testbed, log: Log) -> tuple[dict[str, tuple[float, int]], dict[str, tuple[int, int]]]:
    """Each started device's memory peak and OOM kills, and the bytes its link carried each way, printed."""
    memory, traffic = {}, {}
    for device in tb.devices:
        if device.cgroup is not None:
            memory[device.name] = peak, kills = device.cgroup.memory_peak_mb(), device.cgroup.oom_kills()
            traffic[device.name] = up, down = device.link.traffic()
            log(
                f"testbed: {device.name}: memory peak {peak:.0f} MB, {kills} OOM kills; "
                f"sent {up / 1e6:.1f} MB, received {down / 1e6:.1f} MB"
            )
    return memory, traffic


def _limits(tb: Testbed) -> list[str]:
    out = []
    for c in tb.cfg.testbed.classes:
        cpu = "no CPU limit" if c.cpu is None else f"{c.cpu:g} core"
        mem = "" if c.memory_mb is None else f", {c.memory_mb:g} MB"
        out.append(f"{c.count}x {c.name}: {cpu}{mem}, {c.uplink_mbps:g}/{c.downlink_mbps:g} Mbit/s")
    return out
