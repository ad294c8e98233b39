"""Throwaway PKI for the TLS tests: a CA and a server certificate for 127.0.0.1/localhost.

Made with the ``openssl`` binary (the ``cryptography`` package is not installed
here); tests that need it skip when ``openssl`` is absent.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Pki", "SecretVolume", "der", "make_pki", "openssl_missing", "served_cert"]


def openssl_missing() -> bool:
    return shutil.which("openssl") is None


@dataclass(frozen=True)
class Pki:
    ca: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path


def _run(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(where: Path, name: str = "ca") -> Pki:
    """A fresh CA under ``where/name`` with a server and a client certificate signed by it (EC P-256, 1 day)."""
    d = where / name
    d.mkdir(parents=True)
    _run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1",
         "-subj", f"/CN=test {name}", "-keyout", "ca.key", "-out", "ca.crt", cwd=d)
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for role in ("server", "client"):
        _run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", f"/CN={role}",
             "-keyout", f"{role}.key", "-out", f"{role}.csr", cwd=d)
        _run("x509", "-req", "-in", f"{role}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "1", "-extfile", f"{role}.ext", "-out", f"{role}.crt", cwd=d)
    return Pki(d / "ca.crt", d / "server.crt", d / "server.key", d / "client.crt", d / "client.key")


class SecretVolume:
    """A mounted ``kubernetes.io/tls`` Secret as the kubelet lays it out and updates it: ``tls.crt`` and
    ``tls.key`` are links through ``..data``, a link to the current generation's directory, swapped in
    one ``rename`` (what cert-manager's renewal reaches the pod as)."""

    def __init__(self, root: Path, pki: Pki) -> None:
        self.root, self.generation = root, 0
        root.mkdir()
        self.put(pki)
        for name in ("tls.crt", "tls.key", "ca.crt"):
            (root / name).symlink_to(f"..data/{name}")

    def put(self, pki: Pki, key: Path | None = None) -> None:
        self.generation += 1
        gen = self.root / f"..gen{self.generation}"
        gen.mkdir()
        shutil.copy(pki.cert, gen / "tls.crt")
        shutil.copy(pki.key if key is None else key, gen / "tls.key")
        shutil.copy(pki.ca, gen / "ca.crt")
        (self.root / "..data_tmp").symlink_to(gen.name)
        (self.root / "..data_tmp").replace(self.root / "..data")

    def files(self) -> tuple[Path, Path, Path]:
        """The mounted ``tls.crt``, ``tls.key`` and ``ca.crt``."""
        return self.root / "tls.crt", self.root / "tls.key", self.root / "ca.crt"


def served_cert(port: int) -> bytes:
    """The certificate a TLS handshake with the port gets (DER; no SNI: connected by address)."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock, \
            context.wrap_socket(sock, server_hostname=None) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def der(cert: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(cert.read_text())
