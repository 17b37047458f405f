"""``fleet certs``: a CA, a server certificate a TLS client trusts for the names it was made for, and device
keys ``flwr supernode register`` reads; nothing ever overwritten."""

from __future__ import annotations

import ipaddress
import socket
import ssl
import stat
import threading

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from fleet.cli import main


def test_the_files_a_secure_deployment_needs(tmp_path, capsys):
    out = tmp_path / "certs"
    argv = ["certs", "--out", str(out), "--san", "IP:10.0.0.5", "--san", "server.lan", "--device", "pi1"]
    assert main(argv) == 0
    assert "wrote" in capsys.readouterr().out
    ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    server = x509.load_pem_x509_certificate((out / "server.pem").read_bytes())
    server.verify_directly_issued_by(ca)
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(names.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address(a) for a in ("10.0.0.5", "127.0.0.1")
    }
    assert names.get_values_for_type(x509.DNSName) == ["server.lan"]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for secret in ("ca.key", "server.key", "keys/pi1"):
        assert stat.S_IMODE((out / secret).stat().st_mode) == 0o600, secret
    public = (out / "keys" / "pi1.pub").read_text()
    assert public.startswith("ecdsa-sha2-nistp384 ") and public.strip().endswith(" pi1")
    key = serialization.load_ssh_private_key((out / "keys" / "pi1").read_bytes(), None)
    assert (
        key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        == public.rsplit(" ", 1)[0].encode()
    )


def test_a_tls_client_trusting_the_ca_reaches_the_server_by_loopback(tmp_path):
    out = tmp_path / "certs"
    assert main(["certs", "--out", str(out), "--san", "DNS:server.lan"]) == 0
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(out / "server.pem", out / "server.key")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def serve() -> None:
            conn, _ = listener.accept()
            with server_ctx.wrap_socket(conn, server_side=True) as tls:
                tls.sendall(b"ok")

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        client_ctx = ssl.create_default_context(cafile=str(out / "ca.crt"))
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            with client_ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                assert tls.recv(2) == b"ok"
        thread.join(timeout=10)


def test_nothing_is_overwritten_and_devices_can_be_added_later(tmp_path, capsys):
    out = tmp_path / "certs"
    assert main(["certs", "--out", str(out), "--san", "10.0.0.5", "--device", "pi1"]) == 0
    ca = (out / "ca.crt").read_bytes()
    assert main(["certs", "--out", str(out), "--device", "pi2"]) == 0  # adds a key pair, signs nothing again
    assert (out / "keys" / "pi2.pub").is_file() and (out / "ca.crt").read_bytes() == ca
    assert main(["certs", "--out", str(tmp_path / "pis"), "--device", "pi3"]) == 0  # key pairs alone, no CA
    assert sorted(p.name for p in (tmp_path / "pis").rglob("*") if p.is_file()) == ["pi3", "pi3.pub"]
    capsys.readouterr()
    for argv, message in (
        (["--device", "pi1"], f"{out / 'keys' / 'pi1'} exists; nothing was written"),
        (["--san", "10.0.0.6"], "--san: " + str(out / "ca.key") + " exists"),
    ):
        assert main(["certs", "--out", str(out), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {message}") and "\n" not in err, err


def test_an_out_folder_that_cannot_be_made_is_one_line(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    assert main(["certs", "--out", str(tmp_path / "afile"), "--san", "10.0.0.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --out: cannot make the folder {tmp_path / 'afile'}") and "\n" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "--san: name the address the devices dial"),
        (["--san", "10.0.0.5", "--san", "DNS:two words"], "--san DNS:two words: not a host name"),
        (["--san", "DNS:bücher.lan"], "write its IDNA form, DNS:xn--bcher-kva.lan"),
        (["--san", "192.168.1.300"], "looks like an IP address but is not one"),
        (["--san", "DNS:-bad..lan"], "not a host name"),
        (["--san", "10.0.0.5", "--device", ".."], "--device '..': use 1-64 letters"),
        (["--san", "10.0.0.5", "--device", "pi1", "--device", "pi1"], "--device pi1: named twice"),
        (["--san", "10.0.0.5", "--device", "pi1", "--device", "pi1.pub"], "--device pi1.pub: clashes with pi1's"),
        (["--san", "IP:not-an-ip"], "--san IP:not-an-ip: 'not-an-ip' is not an IP address"),
        (["--san", "10.0.0.5", "--device", "pi 1"], "--device 'pi 1': use 1-64 letters"),
        (["--san", "10.0.0.5", "--days", "0"], "--days: 0 is not allowed"),
    ],
)
def test_bad_flags_are_one_line_and_write_nothing(tmp_path, capsys, argv, message):
    out = tmp_path / "certs"
    assert main(["certs", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and not out.exists()


def test_a_write_that_fails_leaves_none_of_the_files(tmp_path, capsys, monkeypatch):
    """All or none: a full disk at the third file removed the two before it, so the rerun is not refused."""
    from fleet.commands import certs

    real, calls = certs._write, []

    def full_disk(path, data, secret):
        calls.append(path.name)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        real(path, data, secret)

    monkeypatch.setattr(certs, "_write", full_disk)
    out = tmp_path / "certs"
    assert main(["certs", "--out", str(out), "--san", "10.0.0.5", "--device", "pi1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --out: cannot write {out / 'server.pem'} (No space left on device); nothing was " + (
        "written, mend it and run again"
    )
    assert calls == ["ca.crt", "ca.key", "server.pem"] and not [p for p in out.rglob("*") if p.is_file()]
    monkeypatch.setattr(certs, "_write", real)
    assert main(["certs", "--out", str(out), "--san", "10.0.0.5", "--device", "pi1"]) == 0  # the rerun goes through
    assert sorted(p.name for p in out.rglob("*") if p.is_file()) == [
        "ca.crt",
        "ca.key",
        "pi1",
        "pi1.pub",
        "server.key",
        "server.pem",
    ]
