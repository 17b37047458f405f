"""``fleet certs --san IP:192.168.1.10 --device pi1 --device pi2``: what a secure deployment needs.

A CA (``ca.crt``, which every SuperNode and ``flwr`` trust, and ``ca.key``, which stays with you), the
SuperLink's certificate signed by it (``server.pem``, ``server.key``) for the names and addresses the
devices dial plus 127.0.0.1 (``flwr`` and the SuperLink's own executor connect over loopback), and per
device an ECDSA P-384 key pair in OpenSSH format (``keys/<name>``, ``keys/<name>.pub``), the public half
being what ``flwr supernode register`` takes. Made with the ``cryptography`` library that Flower itself
uses, so no openssl command lines to get right.

Nothing is overwritten: an existing file is named in one line and nothing is written. Every flag is checked
and every file made in memory before the first is written, and a write that fails removes the others, so a
run leaves all of its files or none. A call with
``--device`` names alone (no ``--san``) only adds their key pairs.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from pathlib import Path

from fleet.base.errors import ConfigError

NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
LABEL_CHARS = NAME_CHARS - set("_.")  # a DNS label's: letters, digits and '-'


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("certs", help="make the CA, the SuperLink's certificate and the devices' key pairs")
    p.add_argument("--out", default="certs", help="folder to write them to (default: certs)")
    p.add_argument(
        "--san",
        action="append",
        default=[],
        metavar="IP:ADDR|DNS:NAME",
        help="an address or name the devices dial the SuperLink at (repeatable); 127.0.0.1 is always added",
    )
    p.add_argument("--device", action="append", default=[], metavar="NAME", help="a device's key pair (repeatable)")
    p.add_argument("--days", type=int, default=825, help="validity of the certificates in days (default 825)")
    p.set_defaults(func=run)


def parse_san(text: str):
    """``IP:1.2.3.4``, ``DNS:server.lan``, or a bare address or name, as an x509 general name."""
    from cryptography import x509

    kind, sep, value = text.partition(":")
    if not sep or kind.upper() not in ("IP", "DNS"):
        kind, value = ("IP", text) if _is_ip(text) else ("DNS", text)
    if kind.upper() == "IP":
        if not _is_ip(value):
            raise ConfigError(f"--san {text}: {value!r} is not an IP address; write IP:192.168.1.10 or DNS:server.lan")
        return x509.IPAddress(ipaddress.ip_address(value))
    problem = dns_problem(value)
    if problem is not None:
        raise ConfigError(f"--san {text}: {problem}")
    return x509.DNSName(value)


def dns_problem(name: str) -> str | None:
    """Why ``name`` is no host name a certificate can hold (ASCII labels of letters, digits and '-', the
    last not all digits), with the fix; None when it is one."""
    if not name:
        return "give a host name, e.g. DNS:server.lan"
    if not name.isascii():
        try:
            ascii_form = name.encode("idna").decode()
        except UnicodeError:
            return "not a host name; give ASCII letters, digits, '-' and '.', e.g. DNS:server.lan"
        return f"a certificate holds ASCII names; write its IDNA form, DNS:{ascii_form}"
    labels = name.rstrip(".").split(".")
    if len(name) > 253 or not all(label and len(label) <= 63 and set(label) <= LABEL_CHARS for label in labels):
        return "not a host name; give labels of ASCII letters, digits and '-', e.g. DNS:server.lan"
    if labels[-1].isdigit():
        return "looks like an IP address but is not one; write a valid address, e.g. IP:192.168.1.10"
    return None


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _planned(out: Path, devices: list[str], with_server: bool) -> list[Path]:
    server = [out / n for n in ("ca.crt", "ca.key", "server.pem", "server.key")] if with_server else []
    return server + [out / "keys" / f"{d}{ext}" for d in devices for ext in ("", ".pub")]


def check_args(args: argparse.Namespace) -> tuple[Path, list, bool]:
    """The folder, the SANs and whether the CA and server certificate are to be made; one line on bad input
    or on a file that exists (nothing is written then)."""
    if not 1 <= args.days <= 3650:
        raise ConfigError(f"--days: {args.days} is not allowed; use 1 to 3650")
    bad = next((d for d in args.device if not d or not set(d) <= NAME_CHARS or len(d) > 64 or not d[0].isalnum()), None)
    if bad is not None:
        raise ConfigError(
            f"--device {bad!r}: use 1-64 letters, digits, '-', '_' or '.', starting with a letter or digit"
        )
    twice = next((d for i, d in enumerate(args.device) if d in args.device[:i]), None)
    if twice is not None:
        raise ConfigError(f"--device {twice}: named twice; give each device once")
    clash = next((d for d in args.device if d.endswith(".pub") and d[: -len(".pub")] in args.device), None)
    if clash is not None:  # its private key would be written over the other device's public one
        raise ConfigError(f"--device {clash}: clashes with {clash[:-4]}'s public key file; name it without '.pub'")
    out = Path(args.out).expanduser()
    if (out / "ca.key").exists() and args.san:
        raise ConfigError(f"--san: {out / 'ca.key'} exists; to make a new server certificate, use a new --out folder")
    if not args.san and not args.device:
        raise ConfigError("--san: name the address the devices dial the SuperLink at, e.g. --san IP:192.168.1.10")
    with_server = bool(args.san)
    sans = [parse_san(s) for s in args.san]
    existing = [p for p in _planned(out, args.device, with_server) if p.exists()]
    if existing:
        raise ConfigError(f"{existing[0]} exists; nothing was written (remove it, or pick another --out or --device)")
    try:
        (out / "keys" if args.device else out).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"--out: cannot make the folder {out} ({exc.strerror or exc}); give a writable folder"
        ) from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ConfigError(f"--out: the folder {out} is not writable; give a writable folder")
    return out, sans, with_server


Files = dict[Path, tuple[bytes, bool]]  # what to write: each file's bytes and whether it is secret (mode 0600)


def _write(path: Path, data: bytes, secret: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if secret else 0o644)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
    except OSError:
        path.unlink(missing_ok=True)  # made by the open above, so ours: no half-written key is left
        raise


def write_all(files: Files) -> None:
    """Write every file (none overwritten) or none: on the first that fails (a full disk, a file made
    meanwhile) those already written are removed, so a rerun is not refused for half a set."""
    written: list[Path] = []
    for path, (data, secret) in files.items():
        try:
            _write(path, data, secret)
        except OSError as exc:
            for done in written:
                done.unlink(missing_ok=True)
            raise ConfigError(
                f"--out: cannot write {path} ({exc.strerror or exc}); nothing was written, mend it and run again"
            ) from None
        written.append(path)


def _certificate(subject: str, key, issuer: str, signer, days: int, extensions: list):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
    )
    for ext, critical in extensions:
        builder = builder.add_extension(ext, critical=critical)
    return builder.sign(signer, hashes.SHA256())


def make_server(out: Path, sans: list, days: int) -> Files:
    """The CA and the SuperLink's certificate for ``sans`` (and 127.0.0.1), signed by it, to write."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_usage = x509.KeyUsage(False, False, False, False, False, True, True, False, False)
    ca = _certificate(
        "fleet CA", ca_key, "fleet CA", ca_key, days, [(x509.BasicConstraints(True, None), True), (ca_usage, True)]
    )
    names = list(dict.fromkeys([*sans, x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]))
    usage = x509.KeyUsage(True, False, True, False, False, False, False, False, False)
    server = _certificate(
        "fleet SuperLink",
        key,
        "fleet CA",
        ca_key,
        days,
        [
            (x509.SubjectAlternativeName(names), False),
            (x509.BasicConstraints(False, None), True),
            (usage, True),
            (x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), False),
        ],
    )
    pem, pkcs8 = serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8
    plain = serialization.NoEncryption()
    return {
        out / "ca.crt": (ca.public_bytes(pem), False),
        out / "ca.key": (ca_key.private_bytes(pem, pkcs8, plain), True),
        out / "server.pem": (server.public_bytes(pem), False),
        out / "server.key": (key.private_bytes(pem, pkcs8, plain), True),
    }


def make_device_keys(out: Path, name: str) -> Files:
    """``keys/<name>`` (private, stays on the device) and ``keys/<name>.pub`` (to register), as ssh-keygen
    -t ecdsa -b 384 would make them, to write."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    ssh = serialization.Encoding.OpenSSH
    pem, openssh = serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH
    private = key.private_bytes(pem, openssh, serialization.NoEncryption())  # the "OPENSSH PRIVATE KEY" block
    public = key.public_key().public_bytes(ssh, serialization.PublicFormat.OpenSSH) + f" {name}\n".encode()
    return {out / "keys" / name: (private, True), out / "keys" / f"{name}.pub": (public, False)}


def run(args: argparse.Namespace) -> int:
    """Check every flag and file, make every certificate and key in memory, then write them all or none."""
    out, sans, with_server = check_args(args)
    files: Files = make_server(out, sans, args.days) if with_server else {}
    for name in args.device:
        files.update(make_device_keys(out, name))
    write_all(files)
    if with_server:
        shown = ", ".join(s.value if isinstance(s.value, str) else str(s.value) for s in sans)
        print(f"wrote {out}/ca.crt (give it to every device and flwr), ca.key (keep it here, private)")
        print(f"wrote {out}/server.pem and server.key for {shown} and 127.0.0.1 (the SuperLink's --ssl-* flags)")
    for name in args.device:
        print(f"wrote {out}/keys/{name} (copy to the device, private) and {name}.pub (flwr supernode register)")
    return 0
