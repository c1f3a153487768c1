"""`receiver`: a real HTTP server on 127.0.0.1 (a free port) that records every
request and answers with the statuses it is given, in order (200 once they run out).
`proxy`: another, standing where a proxy variable would send requests.
`webhook`: one for the team's environment pointing at the receiver, with its secret.
`resolver`: stands in for DNS for names under .example.test (other names resolve
as usual); `connects`: every address a connection was opened to."""

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from controlplane.webhooks.actions import do_create_webhook


class Receiver:
    def __init__(self) -> None:
        self.requests: list[tuple[dict, bytes]] = []
        self.statuses: list[int] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.requests.append((dict(self.headers), body))
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_port
        self.url = f"http://127.0.0.1:{self.port}/hooks/releasegate"


def _serving(found: Receiver):
    thread = threading.Thread(target=found.server.serve_forever, daemon=True)
    thread.start()
    yield found
    found.server.shutdown()
    found.server.server_close()
    thread.join(timeout=5)


@pytest.fixture
def receiver():
    yield from _serving(Receiver())


@pytest.fixture
def proxy():
    yield from _serving(Receiver())


@pytest.fixture
def webhook(receiver, environment, owner, settings):
    settings.RELEASEGATE_WEBHOOK_ALLOW_PRIVATE = True  # the receiver is local
    return do_create_webhook(environment, receiver.url, actor=owner)


class Resolver:
    """Answers for names under .example.test: `answers` in turn, one list of
    addresses per lookup (the last one again once they run out)."""

    def __init__(self, real) -> None:
        self.real = real
        self.answers: list[list[str]] = []
        self.lookups: list[str] = []

    def __call__(self, host, port, *args, **kwargs):
        if not str(host).endswith(".example.test"):
            return self.real(host, port, *args, **kwargs)
        self.lookups.append(host)
        addresses = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return [
            (
                socket.AF_INET6 if ":" in a else socket.AF_INET,
                socket.SOCK_STREAM,
                socket.IPPROTO_TCP,
                "",
                (a, port or 0, 0, 0) if ":" in a else (a, port or 0),
            )
            for a in addresses
        ]


@pytest.fixture
def resolver(monkeypatch):
    fake = Resolver(socket.getaddrinfo)
    monkeypatch.setattr(socket, "getaddrinfo", fake)
    return fake


@pytest.fixture
def connects(monkeypatch):
    """Connections go through as usual, except to the public address the tests
    name (8.8.8.8), which is refused here: no test reaches out."""
    real = socket.create_connection
    opened: list[tuple[str, int]] = []

    def create_connection(address, *args, **kwargs):
        opened.append((address[0], address[1]))
        if address[0] == "8.8.8.8":
            raise ConnectionRefusedError("refused by the test")
        return real(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", create_connection)
    return opened


def _self_signed(name: str, folder) -> tuple[str, str]:
    """A key and a self-signed certificate for `name` (its own CA), as PEM files."""
    from datetime import UTC, datetime, timedelta

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    key_path, cert_path = folder / f"{name}.key", folder / f"{name}.pem"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_path), str(cert_path)


@pytest.fixture
def tls_receiver(tmp_path, monkeypatch):
    """A receiver over TLS with a certificate for `name`, trusted by the client
    (the one CA it trusts); `server_names` are the SNI names it was sent."""
    import ssl

    import certifi

    servers = []

    def start(name: str) -> Receiver:
        key_path, cert_path = _self_signed(name, tmp_path)
        monkeypatch.setattr(certifi, "where", lambda: cert_path)
        found = Receiver()
        found.server_names = []
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert_path, key_path)
        context.sni_callback = lambda sock, sni, ctx: found.server_names.append(sni)
        found.server.socket = context.wrap_socket(found.server.socket, server_side=True)
        serving = _serving(found)
        next(serving)
        servers.append(serving)
        return found

    yield start
    for serving in servers:
        next(serving, None)
