"""Throwaway PKI for the TLS tests: a CA and a server certificate for 127.0.0.1/localhost.

Made with the ``openssl`` binary (the ``cryptography`` package is not installed
here); tests that need it skip when ``openssl`` is absent.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Pki", "make_pki", "openssl_missing"]


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
