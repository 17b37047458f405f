"""Who can add a device to the fleet: the hardened SuperLink of docs/guide.md, and its restarts.

Real `flower-superlink`, `flower-supernode` and `flwr` processes on loopback, through the harness of
test_deploy_loopback (own FLWR_HOME, free ports, bounded waits, every process killed at the end).

In Flower 1.42 the SuperLink serves its Fleet, Control and Runtime APIs on one socket, and the Control
API (`flwr supernode register`) asks for no credentials. `--enable-supernode-auth` admits only
registered keys, and anyone who reaches the Control API can register one. The documented mitigation:
the SuperLink on 127.0.0.1, and a TLS proxy on the devices' address that forwards only `/v1/fleet/`.
Here 127.0.0.2 plays the devices' address. The proxy is the nginx block of docs/guide.md (when nginx
is installed) or a small Python proxy applying the same rule.

Also: a SuperLink restart with `--database` keeps registered nodes (SuperNodes reconnect, nothing is
registered again); without it, the SuperNodes exit on a 401 and their keys must be registered again.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL, HEARTBEAT_PATIENCE
from flwr.supercore.exit import ExitCode

from tests.test_deploy_loopback import (
    ROOT,
    Deployment,
    Loopback,
    check_two_device_run,
    flwr_try,
    make_node_key,
    tiny_deploy_config,
    wait_port,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

DEVICES_IP = "127.0.0.2"  # the server's address on the devices' network; the SuperLink listens on 127.0.0.1
FLEET_PREFIX = "/v1/fleet/"
DOCS = ROOT / "docs" / "guide.md"
NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if Path(p).is_file()), None)
# How long a heartbeat keeps a node "online" in the SuperLink's state: past this after the SuperLink
# stopped, `flwr supernode ls` shows a node online only if it reached the restarted SuperLink.
ONLINE_WINDOW_S = HEARTBEAT_DEFAULT_INTERVAL * HEARTBEAT_PATIENCE
WAIT_S = 120  # bound of every wait for a process to connect, exit or show up online


def free_port_on(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(5)
        return s.connect_ex((host, port)) == 0


def wait_listening(host: str, port: int, proc: subprocess.Popen, log: Path, timeout: float = WAIT_S) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            pytest.fail(f"process exited early:\n{log.read_text()[-2000:]}")
        if listening(host, port):
            return
        time.sleep(0.3)
    pytest.fail(f"{host}:{port} not open after {timeout}s:\n{log.read_text()[-2000:]}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group, SIGKILL after 30 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def refused_by_proxy(parsed: dict | None) -> bool:
    """A `flwr --format json` answer saying the request got 403 Forbidden."""
    return parsed is not None and parsed.get("success") is False and "403 Forbidden" in parsed.get("error-message", "")


def node_ls(link: Loopback) -> list[dict]:
    code, parsed, text = flwr_try(["supernode", "ls", "loopback"], link.env)
    assert code == 0 and parsed is not None and parsed.get("success") is True, text
    return parsed["nodes"]


def online_ids(nodes: list[dict]) -> set[int]:
    return {int(n["node-id"]) for n in nodes if n["status"] == "online"}


def wait_exit(proc: subprocess.Popen, timeout: float = WAIT_S) -> int | None:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def rogue_home(tmp_path: Path, link: Loopback, gateway: str) -> dict:
    """An intruder's own `flwr`: its own FLWR_HOME holding a copy of ca.crt (every device has it) and
    two connections: `devices` (the proxy, all the devices' network reaches) and `server` (the
    SuperLink's own address, which only the server itself reaches)."""
    home = tmp_path / "rogue-home"
    home.mkdir()
    ca = shutil.copy(link.ca, home / "ca.crt")
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "devices"\n\n'
        f'[superlink.devices]\naddress = "{gateway}"\nroot-certificates = "{ca}"\n\n'
        f'[superlink.server]\naddress = "127.0.0.1:{link.port}"\nroot-certificates = "{ca}"\n'
    )
    return {**link.env, "FLWR_HOME": str(home)}


# ---- the proxy ----------------------------------------------------------------------------------


def serve_fleet_gateway(host: str, port: int, upstream: str, ca: str, cert: str, key: str) -> None:
    """A TLS reverse proxy on ``host``:``port`` that forwards only the Fleet API to ``upstream`` and
    answers 403 to everything else: the rule of docs/guide.md's nginx block, for machines without
    nginx. Runs until killed (in its own process: see ``start_gateway``)."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    client = httpx.AsyncClient(base_url=upstream, verify=ssl.create_default_context(cafile=ca), timeout=300)
    hop = {"host", "connection", "keep-alive", "transfer-encoding", "content-length", "te", "upgrade"}

    async def forward(request: Request) -> Response:
        path = request.url.path  # percent-decoded, as the SuperLink routes it
        if not path.startswith(FLEET_PREFIX) or posixpath.normpath(path) != path:  # no ../ out of it
            return Response("only the Fleet API is served here\n", status_code=403)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in hop]
        reply = await client.request(
            request.method, path, params=request.url.query, headers=headers, content=await request.body()
        )
        out = {k: v for k, v in reply.headers.items() if k.lower() not in hop | {"content-encoding"}}
        return Response(reply.content, status_code=reply.status_code, headers=out)

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
    app = Starlette(routes=[Route("/{path:path}", forward, methods=methods)])
    uvicorn.run(app, host=host, port=port, ssl_certfile=cert, ssl_keyfile=key, log_level="warning")


def documented_nginx_block() -> str:
    """The one ```nginx block of docs/guide.md."""
    blocks = re.findall(r"```nginx\n(.*?)```", DOCS.read_text(), flags=re.S)
    assert len(blocks) == 1, f"docs/guide.md should hold one nginx block, found {len(blocks)}"
    return blocks[0]


def nginx_conf(tmp_path: Path, link: Loopback, port: int) -> Path:
    """nginx.conf for this test: the documented server block with this test's address, ports and
    certificates, inside an http block that keeps pid, logs and temp files under ``tmp_path``."""
    block = documented_nginx_block()
    for placeholder, value in {
        "SERVER_IP:9093": f"{DEVICES_IP}:{port}",
        "https://127.0.0.1:9093": f"https://127.0.0.1:{link.port}",
        "/home/me/fleet/certs/server.pem": str(link.cert),
        "/home/me/fleet/certs/server.key": str(link.key),
    }.items():
        assert placeholder in block, f"the documented nginx block lost {placeholder!r}"
        block = block.replace(placeholder, value)
    temp = tmp_path / "nginx"
    temp.mkdir()
    paths = "\n".join(
        f"    {kind}_temp_path {temp / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    conf = temp / "nginx.conf"
    conf.write_text(
        ("user root;\n" if os.geteuid() == 0 else "")  # workers may read and write this test's tmp dir
        + f"worker_processes 1;\ndaemon off;\npid {temp / 'nginx.pid'};\nerror_log stderr notice;\n"
        + "events { worker_connections 256; }\n"
        + f"http {{\n    access_log {temp / 'access.log'};\n{paths}\n{block}}}\n"
    )
    return conf


def start_gateway(kind: str, tmp_path: Path, link: Loopback) -> str:
    """Starts the proxy on the devices' address; returns that address (host:port)."""
    port = free_port_on(DEVICES_IP)
    if kind == "nginx":
        conf = nginx_conf(tmp_path, link, port)
        check = subprocess.run(
            [NGINX, "-t", "-e", "stderr", "-c", str(conf)], capture_output=True, text=True, timeout=60
        )
        assert check.returncode == 0, check.stdout + check.stderr
        proc = link.start("gateway", [NGINX, "-e", "stderr", "-c", str(conf)])
    else:
        call = (
            f"import sys; sys.path.insert(0, {str(ROOT)!r}); from tests.test_link_security import serve_fleet_gateway; "
            f"serve_fleet_gateway({DEVICES_IP!r}, {port}, 'https://127.0.0.1:{link.port}', {str(link.ca)!r}, "
            f"{str(link.cert)!r}, {str(link.key)!r})"
        )
        proc = link.start("gateway", [sys.executable, "-c", call])
    wait_listening(DEVICES_IP, port, proc, link.logs["gateway"])
    return f"{DEVICES_IP}:{port}"


def probe(address: str, ca: Path, path: str, body: bytes = b"") -> int:
    """HTTP status of a protobuf POST of ``body`` to ``path`` on ``address`` (host:port), over TLS.
    Written by hand so that the path goes out exactly as given (httpx would resolve a literal ``..``)."""
    host, port = address.rsplit(":", 1)
    request = (
        f"POST {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/protobuf\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    context = ssl.create_default_context(cafile=str(ca))
    with socket.create_connection((host, int(port)), timeout=60) as raw:
        with context.wrap_socket(raw, server_hostname=host) as tls:
            tls.sendall(request.encode() + body)
            status_line = tls.makefile("rb").readline().decode()
    assert status_line.startswith("HTTP/1."), status_line
    return int(status_line.split()[1])


def restart_like_systemd(link: Loopback, i: int, node_config: str, timeout: float) -> tuple[subprocess.Popen, int]:
    """Starts device ``i``'s SuperNode (its key, not registered again) and starts it again 10 s after
    each exit, as scripts/flower-supernode.service does (Restart=always, RestartSec=10), until one
    connects (it logs its node id). Returns that process and how many starts it took."""
    deadline = time.time() + timeout
    for start in range(1, 1000):
        name = f"supernode{i}-restart{start}"
        proc = link.start_node(i, node_config, register=False, name=name)
        while proc.poll() is None and time.time() < deadline:
            if "SuperNode ID:" in link.logs[name].read_text():
                return proc, start
            time.sleep(1)
        assert time.time() < deadline, (
            f"device {i} not connected after {timeout}s:\n{link.logs[name].read_text()[-3000:]}"
        )
        log = link.logs[name].read_text()  # refused: its last session still counts as online
        assert f"Exit Code: {ExitCode.SUPERNODE_CONNECTION_ERROR}" in log and "Failed to activate" in log, log[-3000:]
        time.sleep(10)
    raise AssertionError("unreachable")


# ---- tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("proxy", ["nginx", "python"])
def test_hardened_link_admits_only_registered_devices(tmp_path, proxy):
    """The hardened deployment of docs/guide.md: an intruder on the devices' network with ca.crt and
    its own key pair cannot register the key, list anything or get a SuperNode in; registered
    devices train through the proxy; only from the SuperLink's own address can a key be registered,
    and unregistering it puts the intruder out again."""
    if proxy == "nginx" and NGINX is None:
        pytest.skip("nginx is not installed; the python proxy applies the documented rule")
    link = Loopback(tmp_path, secure=True, tls_ips=(DEVICES_IP,))
    config_path, profile = tiny_deploy_config(tmp_path, link.env)

    def node_config(i: int) -> str:
        return f"partition-id={i} tier={i % 2 + 1} profile='{profile}' state-dir='{tmp_path / f'device{i}'}'"

    try:
        link.start_link()
        gateway = start_gateway(proxy, tmp_path, link)
        # The SuperLink is not on the devices' address at all: only the proxy is.
        assert not listening(DEVICES_IP, link.port)

        # An intruder on the devices' network: ca.crt, its own key pair (device 2's key file, so the
        # harness starts its SuperNode with it) and a flwr pointed at the devices' address.
        rogue = rogue_home(tmp_path, link, gateway)
        intruder_key = make_node_key(link.tmp / "keys" / "device2")
        code, parsed, text = flwr_try(["supernode", "register", f"{intruder_key}.pub", "devices"], rogue)
        # The proxy answers 403: the Control API is not there. (`flwr --format json` exits 0 even so.)
        assert refused_by_proxy(parsed), text
        for args in (["supernode", "ls", "devices"], ["ls", "devices"]):
            code, parsed, text = flwr_try(args, rogue)
            assert refused_by_proxy(parsed), text
        # Only /v1/fleet/ passes: the Control and Runtime APIs, the API docs and a path that climbs
        # out of /v1/fleet/ get 403. The same Control/Runtime calls on the SuperLink itself answer.
        for path in (
            "/v1/control/register-node",
            "/v1/control/list-nodes",
            "/v1/runtime/acquire-task",
            "/v1/fleet/%2e%2e/control/list-nodes",
            "/v1/fleet/../control/list-nodes",
            "/openapi.json",
            "/health",
        ):
            assert probe(gateway, link.ca, path) == 403, path
        assert probe(gateway, link.ca, "/v1/fleet/pull-messages") == 401  # reached the SuperLink: no signed key
        assert probe(f"127.0.0.1:{link.port}", link.ca, "/v1/control/list-nodes") == 200
        # A Fleet request bigger than nginx's default 1 MB cap passes and gets the SuperLink's own answer.
        big = bytes(3_000_000)
        direct = probe(f"127.0.0.1:{link.port}", link.ca, "/v1/fleet/push-object", big)
        assert probe(gateway, link.ca, "/v1/fleet/push-object", big) == direct != 413

        # Two registered devices (keys registered by flwr on the server) connect through the proxy;
        # the intruder's SuperNode is refused there like any unregistered key.
        for i in range(2):
            node = link.start_node(i, node_config(i), register=True, superlink=gateway)
            wait_port(int(node.args[node.args.index("--port") + 1]), node, link.logs[f"supernode{i}"], WAIT_S)
        intruder = link.start_node(2, node_config(2), register=False, superlink=gateway, name="intruder")
        intruder_exit = wait_exit(intruder, 90)
        log = link.logs["intruder"].read_text()
        assert intruder_exit == 1, log[-3000:]
        assert f"Exit Code: {ExitCode.SUPERNODE_CONNECTION_ERROR}" in log and "Failed to activate SuperNode" in log
        nodes = link.online_nodes(2, WAIT_S)
        assert sorted(int(n["node-id"]) for n in nodes) == sorted(link.node_ids), nodes
        assert online_ids(nodes) == set(link.node_ids), nodes

        # flwr on the server submits a run; the devices train it through the proxy.
        link.run_to_end(config_path)
        run = tmp_path / "runs" / "deploy"
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        check_two_device_run(tmp_path, Deployment(run, records, dict(link.logs)))

        # What --enable-supernode-auth alone does not stop: the same intruder configuration, pointed
        # at the SuperLink's own address (reachable only from the server), registers its key, and
        # its SuperNode then gets in through the proxy.
        code, parsed, text = flwr_try(["supernode", "register", f"{intruder_key}.pub", "server"], rogue)
        assert code == 0 and parsed is not None and parsed.get("success") is True, text
        intruder_id = int(parsed["node-id"])
        inside = link.start_node(2, node_config(2), register=False, superlink=gateway, name="intruder-registered")
        nodes = link.online_nodes(3, WAIT_S)
        assert online_ids(nodes) == {*link.node_ids, intruder_id}, nodes
        # The remedy: unregister the node. Its next request gets 401 and the SuperNode stops (status 0).
        code, parsed, text = flwr_try(["supernode", "unregister", str(intruder_id), "loopback"], link.env)
        assert code == 0 and parsed is not None and parsed.get("success") is True, text
        assert wait_exit(inside) == 0, link.logs["intruder-registered"].read_text()[-3000:]
        assert online_ids(node_ls(link)) == set(link.node_ids)
    finally:
        link.stop()


def test_database_keeps_registered_nodes_across_a_superlink_restart(tmp_path):
    """With --database, a restarted SuperLink still knows the registered nodes: a SuperNode that kept
    running reconnects, and one restarted meanwhile (by a systemd-like loop) activates with its key once
    its old session has expired, both under their node ids; nothing is registered again."""
    link = Loopback(tmp_path, secure=True, database=tmp_path / "superlink.db")
    try:
        first = link.start_link()
        nodes = {i: link.start_node(i, f"partition-id={i}", register=True) for i in range(3)}
        registered = list(link.node_ids)
        assert online_ids(link.online_nodes(3, WAIT_S)) == set(registered)

        stop(first)
        stopped_at = time.time()
        stop(nodes[1])  # device 1 goes down with the server (it cannot sign off) and is restarted
        stop(nodes[2])  # device 2 stays down: its stored "online" must expire, or ls proves nothing
        time.sleep(5)
        assert nodes[0].poll() is None, link.logs["supernode0"].read_text()[-3000:]  # retrying meanwhile

        link.start_link("superlink-restarted")
        # Device 1 comes back at once. Until its last heartbeat's ONLINE_WINDOW_S has passed, the
        # SuperLink counts its old session as online and refuses a second one (305); a later start gets in.
        restarted, starts = restart_like_systemd(link, 1, "partition-id=1", ONLINE_WINDOW_S + WAIT_S)
        # Past the time for which a heartbeat sent before the restart keeps a node online, "online"
        # means a heartbeat that reached the restarted SuperLink.
        time.sleep(max(0.0, stopped_at + ONLINE_WINDOW_S + 5 - time.time()))
        deadline, nodes_now = time.time() + WAIT_S, []
        while time.time() < deadline:
            nodes_now = node_ls(link)
            if online_ids(nodes_now) == {registered[0], registered[1]}:
                break
            time.sleep(2)
        status = {int(n["node-id"]): n["status"] for n in nodes_now}
        assert status == {registered[0]: "online", registered[1]: "online", registered[2]: "offline"}, nodes_now
        assert link.node_ids == registered  # no key registered again
        assert nodes[0].poll() is None and restarted.poll() is None
        print(f"device 1 connected on start {starts} after the SuperLink restart")
    finally:
        link.stop()


def test_without_database_a_restarted_superlink_forgets_registered_nodes(tmp_path):
    """Without --database, a restarted SuperLink knows no node: the running SuperNode's next request
    gets 401 and it exits with status 0 (hence Restart=always in scripts/flower-supernode.service),
    restarted it is refused until its key is registered again, under a new node id."""
    link = Loopback(tmp_path, secure=True)
    try:
        first = link.start_link()
        node = link.start_node(0, "partition-id=0", register=True)
        old_id = link.node_ids[0]
        assert online_ids(link.online_nodes(1, WAIT_S)) == {old_id}

        stop(first)
        link.start_link("superlink-restarted")
        exit_code = wait_exit(node, ONLINE_WINDOW_S + WAIT_S)
        log = link.logs["supernode0"].read_text()
        # Answered 401 (on a pull or a heartbeat), flower-supernode sends itself SIGINT: it logs only
        # "SuperNode terminated gracefully." and exits with status 0. The 401 shows in the SuperLink's log.
        assert exit_code == 0, log[-3000:]
        assert "SuperNode terminated gracefully." in log, log[-3000:]
        link_log = link.logs["superlink-restarted"].read_text()
        assert re.search(r'"POST /v1/fleet/\S+ HTTP/1.1" 401', link_log), link_log[-3000:]
        assert node_ls(link) == []

        again = link.start_node(0, "partition-id=0", register=False, name="supernode0-restarted")
        log_again = link.logs["supernode0-restarted"]
        assert wait_exit(again, 90) == 1, log_again.read_text()[-3000:]
        assert f"Exit Code: {ExitCode.SUPERNODE_CONNECTION_ERROR}" in log_again.read_text()

        link.start_node(0, "partition-id=0", register=True, name="supernode0-registered-again")
        new_id = link.node_ids[-1]
        assert new_id != old_id
        assert online_ids(link.online_nodes(1, WAIT_S)) == {new_id}
    finally:
        link.stop()
