"""A device's uplink and downlink: its own network namespace, a veth pair to the server's namespace,
and tc on each end (rate with a burst, and a one-way delay).

Design notes:

* **Nothing on the host.** Every namespace, link and address belongs to the testbed: the server's
  namespace ``fleettb-server`` and one ``fleettb-<device>`` each, joined by a veth pair created
  directly inside them. No address or route is added to the host's own interfaces, and traffic
  between the namespaces never leaves the machine.
* **Shaped both ways.** Egress of the device's end is its uplink, egress of the server's end its
  downlink: a token bucket (``tbf``: the rate, with a burst of 10 ms of it) with ``netem`` below it
  for the delay, so a large upload is held to the rate and every packet waits the link's latency.
* **Addresses.** Device ``i`` gets the /30 block ``10.213.0.0/16 + 4i``: the server's end is the
  first address, the device's the second (16,384 devices at most).
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
from dataclasses import dataclass

from fleet.base.errors import FleetError

PREFIX = "fleettb-"  # every namespace the testbed makes
SERVER_NS = PREFIX + "server"
BASE = ipaddress.IPv4Address("10.213.0.0")
MAX_DEVICES = 2**14
BURST_S = 0.01  # a bucket's burst: this long at its rate (and at least one 64 KB TSO segment)


def run(*args: str, ns: str | None = None) -> str:
    """Run an iproute2 command (``ip`` or ``tc``; in namespace ``ns``); its output, or a FleetError with what it
    said."""
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise FleetError(
            f"the testbed needs iproute2 ({cmd[0]} not found); install it (apt-get install iproute2)"
        ) from None
    if done.returncode != 0:
        raise FleetError(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def namespaces() -> list[str]:
    return [line.split()[0] for line in run("ip", "netns", "list").splitlines() if line.strip()]


def addresses(index: int) -> tuple[str, str]:
    """(the server's end, the device's end) of device ``index``'s link."""
    if not 0 <= index < MAX_DEVICES:
        raise FleetError(f"the testbed links at most {MAX_DEVICES} devices; device {index} is one too many")
    first = BASE + 4 * index + 1
    return str(first), str(first + 1)


@dataclass
class Link:
    """Device ``index``'s namespace and its link to the server's, with its rates in Mbit/s and delay in ms."""

    device: str
    index: int
    uplink_mbps: float
    downlink_mbps: float
    latency_ms: float

    @property
    def ns(self) -> str:
        return PREFIX + self.device

    @property
    def server_address(self) -> str:
        return addresses(self.index)[0]

    @property
    def device_address(self) -> str:
        return addresses(self.index)[1]

    def create(self) -> Link:
        """Make the namespace, the shaped link and its addresses; on any failure nothing of it stays."""
        try:
            return self._create()
        except BaseException:
            self.remove()
            raise

    @property
    def device_end(self) -> str:
        return f"ftb{self.index}d"

    def traffic(self) -> tuple[int, int]:
        """Bytes the device's end of its link has sent (its uplink) and received (its downlink): what crossed
        the emulated network, Flower's framing and gRPC included."""
        stats = json.loads(run("ip", "-j", "-s", "link", "show", "dev", self.device_end, ns=self.ns))[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def _create(self) -> Link:
        server_end, device_end = f"ftb{self.index}s", self.device_end
        run("ip", "netns", "add", self.ns)
        run("ip", "link", "set", "lo", "up", ns=self.ns)
        run(
            "ip",
            "link",
            "add",
            server_end,
            "netns",
            SERVER_NS,
            "type",
            "veth",
            "peer",
            "name",
            device_end,
            "netns",
            self.ns,
        )
        run("ip", "addr", "add", f"{self.server_address}/30", "dev", server_end, ns=SERVER_NS)
        run("ip", "addr", "add", f"{self.device_address}/30", "dev", device_end, ns=self.ns)
        run("ip", "link", "set", server_end, "up", ns=SERVER_NS)
        run("ip", "link", "set", device_end, "up", ns=self.ns)
        shape(self.ns, device_end, self.uplink_mbps, self.latency_ms)
        shape(SERVER_NS, server_end, self.downlink_mbps, self.latency_ms)
        return self

    def exec_prefix(self) -> list[str]:
        """Runs the rest of a command line inside the device's namespace."""
        return ["ip", "netns", "exec", self.ns]

    def remove(self) -> None:
        """Its namespace goes, and the veth pair with it."""
        if self.ns in namespaces():
            run("ip", "netns", "del", self.ns)


def shape(ns: str, dev: str, mbps: float, latency_ms: float) -> None:
    """Egress of ``dev``: at most ``mbps`` (a token bucket), each packet delayed ``latency_ms`` (netem)."""
    rate_bytes = mbps * 1e6 / 8
    burst = max(65536, int(rate_bytes * BURST_S))
    tc = ["tc", "qdisc", "add", "dev", dev]
    run(*tc, "root", "handle", "1:", "tbf", "rate", f"{mbps}mbit", "burst", str(burst), "latency", "1s", ns=ns)
    if latency_ms > 0:
        run(*tc, "parent", "1:1", "handle", "10:", "netem", "delay", f"{latency_ms}ms", "limit", "100000", ns=ns)


def has_netem() -> bool:
    """Whether this kernel can delay packets (the sch_netem qdisc): tried on a throwaway namespace's loopback."""
    probe = PREFIX + "netem-probe"
    run("ip", "netns", "add", probe)
    try:
        run("ip", "link", "set", "lo", "up", ns=probe)
        run("tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms", ns=probe)
        return True
    except FleetError:
        return False
    finally:
        run("ip", "netns", "del", probe)


def create_server_namespace() -> str:
    run("ip", "netns", "add", SERVER_NS)
    run("ip", "link", "set", "lo", "up", ns=SERVER_NS)
    return SERVER_NS


def remove_stale() -> list[str]:
    """Delete every namespace a testbed left behind (their links go with them); the names removed."""
    stale = [n for n in namespaces() if n.startswith(PREFIX)]
    for name in stale:
        run("ip", "netns", "del", name)
    return stale
